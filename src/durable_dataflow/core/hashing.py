"""Canonical hashing: SHA-256 over RFC 8785 canonical JSON, written ``sha256:<hex>``.

RFC 8785 allows only integers within +/-(2**53 - 1) and no Decimal, bytes or datetime values:
callers convert those to strings before hashing (see ``reference/sinks-and-libs.md`` §5).
"""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785

from durable_dataflow.core.errors import InputError

PREFIX = "sha256:"


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 canonical bytes of a JSON-compatible value."""
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
