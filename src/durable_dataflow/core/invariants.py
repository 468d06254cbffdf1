"""An always-on assertion: what must hold, checked even under ``python -O`` (where ``assert`` vanishes)."""

from __future__ import annotations


class InvariantViolation(AssertionError):
    """A condition the protocol guarantees did not hold: a bug, never bad input."""


def invariant(condition: bool, message: str) -> None:
    """Raise :class:`InvariantViolation` when ``condition`` is false."""
    if not condition:
        raise InvariantViolation(message)
