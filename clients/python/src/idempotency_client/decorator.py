"""`@idempotent`: a function that runs once per key, in the style of AWS Powertools."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypedDict, TypeVar, overload

from ._core import RunOptions
from .aio import AsyncIdempotencyClient, AsyncLease
from .client import IdempotencyClient, Lease

if TYPE_CHECKING:
    from typing_extensions import Unpack

P = ParamSpec("P")
R = TypeVar("R")


class _Keyed(TypedDict):
    namespace: str
    key: Callable[..., str]


class _IdempotentOptions(_Keyed, RunOptions, total=False):
    """`idempotent`'s keyword arguments: `namespace` and `key` are required."""

    fingerprint: Callable[..., object] | None


@overload
def idempotent(
    client: IdempotencyClient, **options: Unpack[_IdempotentOptions]
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


@overload
def idempotent(
    client: AsyncIdempotencyClient, **options: Unpack[_IdempotentOptions]
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]: ...


def idempotent(
    client: IdempotencyClient | AsyncIdempotencyClient,
    *,
    namespace: str,
    key: Callable[..., str],
    fingerprint: Callable[..., object] | None = None,
    **options: Unpack[RunOptions],
) -> Any:
    """Makes a function run at most once per key: later calls with the same key return the
    stored result instead of running it again.

    `key` and `fingerprint` are called with the function's own arguments: `key` names the
    operation, `fingerprint` picks what identifies the request (hashed as canonical JSON, or as
    bytes); without it every argument is hashed, so they must be JSON values. The result must
    suit `codec` (JSON by default). The other options are `run_once`'s. With an
    `AsyncIdempotencyClient`, decorate `async def` functions."""

    def identify(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, object]:
        """One call's key, and what its fingerprint hashes: the caller's choice, or every
        argument (as canonical JSON)."""
        call_key = key(*args, **kwargs)
        if fingerprint is not None:
            return call_key, fingerprint(*args, **kwargs)
        return call_key, {"args": list(args), "kwargs": kwargs}

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        if isinstance(client, AsyncIdempotencyClient):
            if not inspect.iscoroutinefunction(function):
                raise TypeError("@idempotent with an AsyncIdempotencyClient needs an async def")
            async_client = client

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                async def work(_lease: AsyncLease) -> Any:
                    return await function(*args, **kwargs)

                call_key, request = identify(args, kwargs)
                outcome = await async_client.run_once(
                    namespace, call_key, work, request=request, **options
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

            call_key, request = identify(args, kwargs)
            outcome = sync_client.run_once(namespace, call_key, work, request=request, **options)
            return outcome.value

        return run

    return decorate
