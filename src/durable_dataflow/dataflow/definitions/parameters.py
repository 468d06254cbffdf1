"""Request parameters: checked against their declared types, in canonical JSON form.

The CLI passes every value as a string (``--param day=2026-11-02``); the API passes typed JSON.
Both become the same canonical JSON value, so the request hash does not depend on how a value
was typed: dates and timestamps as ISO strings (aware timestamps normalized to UTC), decimals as
normalized strings, integers within +/-(2**53-1) so RFC 8785 can hash them.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import re
from collections.abc import Mapping
from typing import Any, Protocol

from durable_dataflow.core.errors import InputError

JSON_INT_MAX = 2**53 - 1
DECIMAL_DIGITS_MAX = 38
STRING_PARAMETER_CHARS_MAX = 10_000



class Declared(Protocol):
    """One declared parameter, as the definition document holds it (definitions.ParameterSpec): this
    module checks values against declarations without importing the document that declares them."""

    @property
    def type(self) -> str: ...

    @property
    def default(self) -> str | int | float | bool | None: ...


class Declaring(Protocol):
    """What declares parameters (definitions.Definition)."""

    @property
    def parameters(self) -> Mapping[str, Declared]: ...


_INT_TEXT = re.compile(r"^[+-]?\d{1,20}$")
_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})


class ParameterValueError(ValueError):
    """A value does not fit its declared type; the message says why."""


def _int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ParameterValueError("a boolean is not an integer")
    if isinstance(raw, str):
        if not _INT_TEXT.match(raw.strip()):
            raise ParameterValueError("not an integer")
        raw = int(raw.strip())
    if not isinstance(raw, int):
        raise ParameterValueError("not an integer")
    if abs(raw) > JSON_INT_MAX:
        raise ParameterValueError("outside +/-(2**53-1)")
    return raw


def _float(raw: Any) -> float:
    if isinstance(raw, bool):
        raise ParameterValueError("a boolean is not a number")
    if isinstance(raw, str):
        try:
            raw = float(raw.strip())
        except ValueError:
            raise ParameterValueError("not a number") from None
    if not isinstance(raw, int | float):
        raise ParameterValueError("not a number")
    value = float(raw)
    if not math.isfinite(value):
        raise ParameterValueError("NaN and infinity are not allowed")
    return value


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise ParameterValueError("not a boolean: use true or false")


def _date(raw: Any) -> str:
    if isinstance(raw, dt.datetime):
        raise ParameterValueError("a timestamp is not a date")
    if isinstance(raw, dt.date):
        return raw.isoformat()
    if not isinstance(raw, str):
        raise ParameterValueError("not a date: use YYYY-MM-DD")
    try:
        return dt.date.fromisoformat(raw.strip()).isoformat()
    except ValueError:
        raise ParameterValueError("not a date: use YYYY-MM-DD") from None


def _timestamp(raw: Any) -> str:
    if isinstance(raw, dt.datetime):
        value = raw
    elif isinstance(raw, str):
        try:
            value = dt.datetime.fromisoformat(raw.strip())
        except ValueError:
            raise ParameterValueError("not a timestamp: use ISO 8601, e.g. 2026-11-02T08:30:00Z") from None
    else:
        raise ParameterValueError("not a timestamp: use ISO 8601, e.g. 2026-11-02T08:30:00Z")
    if value.tzinfo is not None:
        # One instant, one spelling: +01:00 and Z forms of the same moment hash alike. An instant
        # whose UTC form falls outside years 1..9999 has no spelling (0001-01-01T00:00+01:00).
        try:
            value = value.astimezone(dt.UTC)
        except OverflowError:
            raise ParameterValueError("out of range: in UTC it must fall within years 1 to 9999") from None
    return value.isoformat()


def _fixed_point_digits(value: decimal.Decimal) -> int:
    """The digits of a non-zero finite value written without an exponent and without trailing
    zeros after the point: its integer digits plus its fraction digits (a DECIMAL's precision)."""
    digits, exponent = value.as_tuple().digits, int(value.as_tuple().exponent)  # an int: finite
    kept = len("".join(map(str, digits)).rstrip("0"))
    exponent += len(digits) - kept
    return max(kept + exponent, 0) + max(-exponent, 0)


def _decimal(raw: Any) -> str:
    if isinstance(raw, bool | float):
        raise ParameterValueError("give a decimal as a string (e.g. \"12.50\") so it stays exact")
    if not isinstance(raw, str | int):
        raise ParameterValueError("not a decimal")
    try:
        value = decimal.Decimal(str(raw).strip())
    except decimal.InvalidOperation:
        raise ParameterValueError("not a decimal") from None
    if not value.is_finite():
        raise ParameterValueError("NaN and infinity are not allowed")
    if len(value.as_tuple().digits) > DECIMAL_DIGITS_MAX:
        raise ParameterValueError(f"more than {DECIMAL_DIGITS_MAX} digits")
    if value.is_zero():
        return "0"
    if _fixed_point_digits(value) > DECIMAL_DIGITS_MAX:  # 1e38, 1e-39 and 1e999999 are one digit long
        raise ParameterValueError(f"more than {DECIMAL_DIGITS_MAX} digits when written without an exponent")
    # normalize() rounds to its context's precision, 28 digits by default: every digit allowed is kept.
    text = format(value.normalize(decimal.Context(prec=DECIMAL_DIGITS_MAX)), "f")
    return "0" if text in ("-0", "0") else text


def _string(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ParameterValueError("not a string")
    if len(raw) > STRING_PARAMETER_CHARS_MAX:
        raise ParameterValueError(f"longer than {STRING_PARAMETER_CHARS_MAX} characters")
    return raw


_COERCE = {
    "string": _string, "int": _int, "float": _float, "bool": _bool,
    "date": _date, "timestamp": _timestamp, "decimal": _decimal,
}


def coerce(type_name: str, raw: Any) -> Any:
    """The canonical JSON value of raw for a declared type; ParameterValueError when it does not fit."""
    if raw is None:
        raise ParameterValueError("null is not a value")
    return _COERCE[type_name](raw)


def to_python(type_name: str, canonical: Any) -> Any:
    """The Python value to bind in DuckDB for a canonical value."""
    if type_name == "date":
        return dt.date.fromisoformat(canonical)
    if type_name == "timestamp":
        return dt.datetime.fromisoformat(canonical)
    if type_name == "decimal":
        return decimal.Decimal(canonical)
    return canonical


def check_parameters(d: Declaring, raw: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical values for every declared parameter: typed, defaults filled, unknown names refused.

    Messages name the parameter and the rule, never the value received: a value may be a secret
    someone pasted into the wrong field, and messages are returned, logged and shown to operators.
    """
    declared = d.parameters
    unknown = sorted(set(raw) - set(declared))
    if unknown:
        names = ", ".join(sorted(declared)) or "none"
        raise InputError(f"unknown parameter {unknown[0]!r}: the definition declares {names}")
    values: dict[str, Any] = {}
    for name, spec in declared.items():
        if name not in raw:
            if spec.default is None:
                raise InputError(f"parameter {name!r} ({spec.type}) is required and has no default")
            values[name] = spec.default
            continue
        try:
            values[name] = coerce(spec.type, raw[name])
        except ParameterValueError as exc:
            problem = f"parameter {name!r} is declared {spec.type}; the value given does not fit: {exc}"
            raise InputError(problem) from None
    return values


def bind_values(d: Declaring, params: Mapping[str, Any]) -> dict[str, Any]:
    """Python values (date, datetime, Decimal, ...) for DuckDB named parameters ``$name``."""
    canonical = check_parameters(d, params)
    return {name: to_python(d.parameters[name].type, value) for name, value in canonical.items()}


def resolve_partition(partition: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A target's partition with each "$name" replaced by the run's canonical value of parameter
    `name` (literals unchanged). InputError, naming the column, when a referenced value is missing."""
    resolved: dict[str, Any] = {}
    for column, value in partition.items():
        if isinstance(value, str) and value.startswith("$"):
            name = value[1:]
            if values.get(name) is None:
                raise InputError(f"partition column {column!r}: parameter {name!r} has no value in this run")
            resolved[column] = values[name]
        else:
            resolved[column] = value
    return resolved
