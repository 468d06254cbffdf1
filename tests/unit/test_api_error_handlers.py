"""The API's exception handlers check the kind of error they were given always, not with ``assert``.

An ``assert`` vanishes under ``python -O``; ``api.errors.handled_as`` raises an InvariantViolation there
too, and returns the error narrowed to its kind (for mypy) when it is the registered one.
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi.exceptions import RequestValidationError

from durable_dataflow.api import errors
from durable_dataflow.core.errors import DataflowError, InputError
from durable_dataflow.core.invariants import InvariantViolation


def test_handled_as_returns_the_registered_kind_and_refuses_another() -> None:
    """Proves handled_as passes an error of the handler's kind (or a subclass) through unchanged and raises
    InvariantViolation, naming both kinds, for any other, by calling it with each."""
    error = InputError("bad")
    assert errors.handled_as(error, DataflowError) is error
    with pytest.raises(InvariantViolation, match="RequestValidationError was called with InputError"):
        errors.handled_as(error, RequestValidationError)


def test_a_handler_given_the_wrong_kind_raises_instead_of_answering() -> None:
    """Proves on_validation_error refuses a DataflowError (a mis-registration) rather than misreading it, by
    calling the coroutine directly."""
    with pytest.raises(InvariantViolation):
        asyncio.run(errors.on_validation_error(None, InputError("bad")))  # type: ignore[arg-type]
