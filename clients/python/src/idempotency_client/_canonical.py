"""RFC 8785 (JCS) canonical JSON of a value or of a JSON text, and the fingerprints made of it.

The rules every client follows (clients/conformance/README.md, and the vectors there): objects
sorted by the UTF-16 code units of their keys, the fewest escapes, numbers as ECMAScript writes
doubles. Beyond RFC 8785, as I-JSON (RFC 7493) asks: a duplicate key, a lone surrogate and an
integer beyond ±(2^53-1) are refused, the last because rounding it to a double would let two
different requests share a fingerprint (send such a number as a string).
"""

from __future__ import annotations

import hashlib
import json
import math

import rfc8785

from .errors import CanonicalJsonError

MAX_SAFE_INTEGER = 2**53 - 1
"""The largest integer that every client's JSON reads exactly (JavaScript's
`Number.MAX_SAFE_INTEGER`); beyond it, in either direction, an integer is refused."""


def canonical_json(value: object) -> bytes:
    """The RFC 8785 canonical JSON of `value` (None, bool, int, float, str, lists, tuples and
    dicts with str keys), as UTF-8 bytes. Raises `CanonicalJsonError` for what it cannot
    represent exactly: an int beyond ±(2^53-1), a NaN or infinite float, a str with a lone
    surrogate, another type or a key that is not a str."""
    try:
        return rfc8785.dumps(value)  # type: ignore[arg-type]
    except rfc8785.IntegerDomainError as error:
        raise CanonicalJsonError(
            "unsafe_integer",
            f"{error}: an integer beyond ±(2^53-1) would be rounded; send it as a string",
        ) from error
    except rfc8785.FloatDomainError as error:
        raise CanonicalJsonError("number_out_of_range", str(error)) from error
    except UnicodeEncodeError as error:
        raise CanonicalJsonError("lone_surrogate", "a string holds a lone surrogate") from error
    except rfc8785.CanonicalizationError as error:
        if isinstance(error.__cause__ or error.__context__, UnicodeEncodeError):
            raise CanonicalJsonError("lone_surrogate", "a string holds a lone surrogate") from error
        raise CanonicalJsonError("not_json", str(error)) from error


def canonical_json_text(text: str | bytes) -> bytes:
    """The RFC 8785 canonical form of a JSON text (a `str`, or UTF-8 bytes such as a request
    body): the same bytes as `canonical_json` of the value it holds. Raises
    `CanonicalJsonError` for a text that is not JSON (`invalid_json`, also for `NaN` and
    `Infinity`), a key twice in one object (`duplicate_key`), an integer literal beyond
    ±(2^53-1) (`unsafe_integer`), a number beyond the largest double (`number_out_of_range`)
    or a lone surrogate (`lone_surrogate`)."""
    try:
        value = json.loads(
            text,
            object_pairs_hook=_object_without_duplicates,
            parse_int=_safe_integer,
            parse_float=_finite_number,
            parse_constant=_not_json,
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CanonicalJsonError("invalid_json", f"not a JSON text: {error}") from error
    return canonical_json(value)


def fingerprint_of(request: object) -> bytes:
    """SHA-256 of the request: of its bytes as they are, or of its RFC 8785 canonical JSON, so
    that equal requests hash alike whatever the order of their keys or the language that made
    them. Raises `CanonicalJsonError` for a value `canonical_json` refuses."""
    if isinstance(request, bytes | bytearray | memoryview):
        return hashlib.sha256(request).digest()
    return hashlib.sha256(canonical_json(request)).digest()


def fingerprint_of_json(text: str | bytes) -> bytes:
    """SHA-256 of the canonical form of a JSON text (`canonical_json_text`): the fingerprint
    `fingerprint_of` gives the value the text holds, so a body fingerprinted as it arrived
    matches the same request built as a value, in any client."""
    return hashlib.sha256(canonical_json_text(text)).digest()


def _object_without_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    members: dict[str, object] = {}
    for key, value in pairs:
        if key in members:
            raise CanonicalJsonError("duplicate_key", f"the key {key!r} occurs twice in an object")
        members[key] = value
    return members


def _safe_integer(literal: str) -> int:
    number = int(literal)
    if abs(number) > MAX_SAFE_INTEGER:
        raise CanonicalJsonError(
            "unsafe_integer",
            f"the integer {literal} is beyond ±(2^53-1) and would be rounded; send it as a string",
        )
    return number


def _finite_number(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise CanonicalJsonError(
            "number_out_of_range", f"the number {literal} is beyond the largest double"
        )
    return number


def _not_json(literal: str) -> object:
    raise CanonicalJsonError("invalid_json", f"{literal} is not JSON")
