"""`@idempotent`: a function that runs once per key, in the style of AWS Powertools."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar, overload

from ._core import JSON, Codec, Duration, ErrorResult
from .aio import AsyncIdempotencyClient, AsyncLease
from .client import IdempotencyClient, Lease

P = ParamSpec("P")
R = TypeVar("R")


def _fingerprint_source(
    fingerprint: Callable[..., object] | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> object:
    """What the fingerprint hashes: the caller's choice, or every argument (as canonical JSON)."""
    if fingerprint is not None:
        return fingerprint(*args, **kwargs)
    return {"args": list(args), "kwargs": kwargs}


@overload
def idempotent(
    client: IdempotencyClient,
    *,
    namespace: str,
    key: Callable[..., str],
    fingerprint: Callable[..., object] | None = None,
    lease_ttl: Duration = 30.0,
    retention: Duration | None = None,
    wait: Duration = 0.0,
    heartbeat: bool | Duration = True,
    codec: Codec = JSON,
    error_result: ErrorResult | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


@overload
def idempotent(
    client: AsyncIdempotencyClient,
    *,
    namespace: str,
    key: Callable[..., str],
    fingerprint: Callable[..., object] | None = None,
    lease_ttl: Duration = 30.0,
    retention: Duration | None = None,
    wait: Duration = 0.0,
    heartbeat: bool | Duration = True,
    codec: Codec = JSON,
    error_result: ErrorResult | None = None,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]: ...


def idempotent(
    client: IdempotencyClient | AsyncIdempotencyClient,
    *,
    namespace: str,
    key: Callable[..., str],
    fingerprint: Callable[..., object] | None = None,
    lease_ttl: Duration = 30.0,
    retention: Duration | None = None,
    wait: Duration = 0.0,
    heartbeat: bool | Duration = True,
    codec: Codec = JSON,
    error_result: ErrorResult | None = None,
) -> Any:
    """Makes a function run at most once per key: later calls with the same key return the
    stored result instead of running it again.

    `key` and `fingerprint` are called with the function's own arguments: `key` names the
    operation, `fingerprint` picks what identifies the request (hashed as canonical JSON, or as
    bytes); without it every argument is hashed, so they must be JSON values. The result must
    suit `codec` (JSON by default). The other options are `run_once`'s. With an
    `AsyncIdempotencyClient`, decorate `async def` functions."""
    options: dict[str, Any] = {
        "lease_ttl": lease_ttl,
        "retention": retention,
        "wait": wait,
        "heartbeat": heartbeat,
        "codec": codec,
        "error_result": error_result,
    }

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        if isinstance(client, AsyncIdempotencyClient):
            if not inspect.iscoroutinefunction(function):
                raise TypeError("@idempotent with an AsyncIdempotencyClient needs an async def")
            async_client = client

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                async def work(_lease: AsyncLease) -> Any:
                    return await function(*args, **kwargs)

                outcome = await async_client.run_once(
                    namespace,
                    key(*args, **kwargs),
                    work,
                    request=_fingerprint_source(fingerprint, args, kwargs),
                    **options,
                )
                return outcome.value

            return run_async

        if inspect.iscoroutinefunction(function):
            raise TypeError("@idempotent on an async def needs an AsyncIdempotencyClient")
        sync_client = client

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            def work(_lease: Lease) -> Any:
                return function(*args, **kwargs)

            outcome = sync_client.run_once(
                namespace,
                key(*args, **kwargs),
                work,
                request=_fingerprint_source(fingerprint, args, kwargs),
                **options,
            )
            return outcome.value

        return run

    return decorate
