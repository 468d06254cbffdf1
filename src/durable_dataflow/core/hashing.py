"""Canonical hashing: SHA-256 over RFC 8785 canonical JSON, written ``sha256:<hex>``.

RFC 8785 allows only integers within +/-(2**53 - 1) and no Decimal, bytes or datetime values:
callers convert those to strings before hashing (see ``reference/sinks-and-libs.md`` §5).

Most values hashed per run (ledger payloads, chain links) hold only ASCII strings, safe integers,
booleans and None. For those, RFC 8785's output is exactly what the standard library's C encoder writes
with sorted keys and no spaces: ASCII keys sort the same by UTF-16 code unit and by code point, both
escape ``"``, ``\\`` and the control characters alike (``\\b \\t \\n \\f \\r``, else ``\\u00xx``), and a
safe integer prints as its digits. ``canonical_json`` takes that path after checking the value holds
nothing else (``_plain``) and ``rfc8785`` for every other value; ``tests/unit/test_hashing_fast.py``
holds the two to the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import rfc8785

from durable_dataflow.core.errors import InputError

PREFIX = "sha256:"


_SAFE_INTEGER_MAX = 2**53 - 1
_PLAIN_DEPTH_MAX = 64  # deeper values take rfc8785's path (and its own checks)
_ENCODE_PLAIN = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds only ASCII strings, safe integers, booleans, None, lists and str-keyed dicts."""
    if value is None or value is True or value is False:
        return True
    if isinstance(value, str) and type(value) is str:
        return value.isascii()
    if isinstance(value, int) and type(value) is int:
        return -_SAFE_INTEGER_MAX <= value <= _SAFE_INTEGER_MAX
    kind = type(value)
    if depth >= _PLAIN_DEPTH_MAX:
        return False
    if kind is dict:
        return all(type(k) is str and k.isascii() and _plain(v, depth + 1) for k, v in value.items())
    if kind is list or kind is tuple:
        return all(_plain(item, depth + 1) for item in value)
    return False


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 canonical bytes of a JSON-compatible value (the standard library's encoder for a
    plain value, which writes the same bytes; see the module's docstring)."""
    if _plain(value):
        return _ENCODE_PLAIN(value).encode("ascii")
    try:
        return bytes(rfc8785.dumps(value))
    except rfc8785.CanonicalizationError as exc:
        raise InputError(f"value cannot be canonicalized as JSON: {exc}") from exc


def sha256_bytes(data: bytes) -> str:
    """``sha256:<hex>`` of raw bytes."""
    return PREFIX + hashlib.sha256(data).hexdigest()


def digest(value: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of a value."""
    return sha256_bytes(canonical_json(value))


def is_digest(text: str) -> bool:
    """True when text has the ``sha256:<64 hex>`` form."""
    hexpart = text[len(PREFIX) :]
    return text.startswith(PREFIX) and len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)
