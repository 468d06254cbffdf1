"""JSON parsing that refuses duplicate object keys, and the one way to write a path into a document.

``json.loads`` keeps the last of two equal keys silently, so ``{"max_attempts": 1, "max_attempts": 20}``
means whatever the last parser in a chain decides, and a reviewer reading the first key is misled.
:func:`loads` refuses such a document with :class:`DuplicateKey`, which names where the key is
(``sources.orders.path``) but never a value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# Nesting deeper than this is refused before the duplicate search walks it (json itself stops near 1000).
DEPTH_MAX = 1000


class DuplicateKey(ValueError):
    """An object in the document holds one key twice; ``path`` is where (the key included)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"duplicate key {path}")
        self.path = path


def path_text(parts: Sequence[str | int]) -> str:
    """A location in a document as ``a.b[0].c``; the empty path is ``(document)``."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else ("." if text else "") + str(part)
    return text or "(document)"


def loads(text: str | bytes) -> Any:
    """The JSON value of ``text``; json.JSONDecodeError when malformed, DuplicateKey on a repeated key."""
    repeated: list[tuple[dict[str, Any], str]] = []

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        built: dict[str, Any] = {}
        for key, value in pairs:
            if key in built and not repeated:
                repeated.append((built, key))
            built[key] = value
        return built

    value = json.loads(text, object_pairs_hook=build)
    if repeated:
        holder, key = repeated[0]
        raise DuplicateKey(path_text([*_path_to(value, holder), key]))
    return value


def _path_to(document: Any, target: dict[str, Any]) -> list[str | int]:
    """The path from the document's root to the object ``target`` (found by identity)."""
    pending: list[tuple[Any, list[str | int]]] = [(document, [])]
    while pending:  # an explicit stack, not recursion (STYLE)
        item, path = pending.pop()
        if item is target:
            return path
        if len(path) >= DEPTH_MAX:
            continue
        if isinstance(item, dict):
            pending.extend((child, [*path, key]) for key, child in item.items())
        elif isinstance(item, list):
            pending.extend((child, [*path, index]) for index, child in enumerate(item))
    return []
