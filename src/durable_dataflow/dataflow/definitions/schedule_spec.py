"""A definition's ``schedule:`` block: the model, its ticks (cron in an IANA time zone) and the
parameter expressions that derive each run's parameters from its tick (docs/schedules.md).

Ticks: the 5-field cron expression (parsed by ``croniter``) is matched against the **local wall
clock** of ``timezone`` (``zoneinfo``); each matching wall time becomes one instant in UTC:

- a wall time that exists once is that instant;
- a wall time that exists twice (the repeated hour when clocks go back) is its **first**
  occurrence, so it fires once;
- a wall time that does not exist (the skipped hour when clocks go forward) fires once at the
  **next valid instant**, the moment the clocks jumped; several skipped wall times (``*/15 2 * * *``)
  and a real wall time at that same instant are one tick.

Parameter expressions: a value is a literal, or a string with ``{{ ... }}`` parts, each one of
``tick.date``, ``tick.date - N day(s)``, ``tick.date + N day(s)`` (the tick's local date in the
schedule's time zone) or ``tick.iso`` (the tick instant in UTC, ISO 8601 with ``Z``). They are
parsed by a regular expression, never evaluated as code.

This module imports nothing of the rest of ``dataflow`` but ``parameters`` (definitions import it).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from durable_dataflow.dataflow.definitions import parameters as parameters_mod

OverlapPolicy = Literal["skip", "buffer_one", "allow"]
CRON_CHARS_MAX = 200
TIMEZONE_CHARS_MAX = 64
EXPRESSION_CHARS_MAX = 500
DAY_OFFSET_MAX = 3660  # ten years of days: more is a typo
SCHEDULE_PARAMETERS_MAX = 64
CATCHUP_WINDOW_S_MIN = 60
CATCHUP_WINDOW_S_MAX = 366 * 86_400
CATCHUP_WINDOW_DEFAULT = "1d"
# The skip-ahead before the first candidate: wider than any DST shift (at most 2 h anywhere).
_LOOKBACK = dt.timedelta(hours=3)
# Ticks are on whole seconds: the search for the end of a skipped hour converges in < 20 steps.
_GAP_SEARCH_STEPS_MAX = 64

# croniter's random and hashed field forms (R, R(0-30), H/5...), refused: ticks must not move.
_MOVING_FIELD = re.compile(r"^[hr](\(\d+-\d+\))?(/\d+)?$", re.IGNORECASE | re.ASCII)
_DURATION = re.compile(r"^\s*(\d{1,9})\s*(s|m|h|d)\s*$")
_DURATION_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
_PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_EXPRESSION = re.compile(
    r"^\s*tick\.(?:(?P<iso>iso)|(?P<date>date)(?:\s*(?P<sign>[+-])\s*(?P<n>\d{1,5})\s*days?)?)\s*$"
)


def parse_window(value: str) -> int:
    """Seconds in a catch-up window written as ``90s``, ``10m``, ``2h`` or ``2d``."""
    match = _DURATION.match(value)
    if not match:
        raise ValueError("catchup_window is not valid: write e.g. '30m', '6h' or '2d'")
    seconds = int(match.group(1)) * _DURATION_UNITS_S[match.group(2)]
    if not CATCHUP_WINDOW_S_MIN <= seconds <= CATCHUP_WINDOW_S_MAX:
        raise ValueError("catchup_window must be between 1 minute and 366 days")
    return seconds


@dataclass(frozen=True)
class Tick:
    """One tick: its instant (UTC) and its local date in the schedule's time zone."""

    instant: dt.datetime  # aware, UTC, whole seconds
    local_date: dt.date

    @property
    def iso(self) -> str:
        return iso_utc(self.instant)


def iso_utc(instant: dt.datetime) -> str:
    """``2026-03-29T01:00:00Z``: the form used in keys and in ``tick.iso``."""
    return instant.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- parameter expressions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    literal: str | None = None
    field: Literal["iso", "date"] | None = None
    days: int = 0


def parse_template(text: str) -> list[_Part]:
    """The parts of a parameter value; ValueError naming the problem for anything else."""
    if len(text) > EXPRESSION_CHARS_MAX:
        raise ValueError(f"a parameter expression is longer than {EXPRESSION_CHARS_MAX} characters")
    parts: list[_Part] = []
    position = 0
    for found in _PLACEHOLDER.finditer(text):
        if found.start() > position:
            parts.append(_Part(literal=text[position : found.start()]))
        expression = _EXPRESSION.match(found.group(1))
        if expression is None:
            raise ValueError(
                "a parameter expression must be one of {{ tick.date }}, {{ tick.date - N days }}, "
                "{{ tick.date + N days }} or {{ tick.iso }}"
            )
        if expression.group("iso"):
            parts.append(_Part(field="iso"))
        else:
            days = int(expression.group("n") or 0)
            if days > DAY_OFFSET_MAX:
                raise ValueError(f"a day offset must be at most {DAY_OFFSET_MAX}")
            parts.append(_Part(field="date", days=-days if expression.group("sign") == "-" else days))
        position = found.end()
    rest = text[position:]
    if "{{" in rest or "}}" in rest:
        raise ValueError("a parameter expression has an unmatched '{{' or '}}'")
    if rest:
        parts.append(_Part(literal=rest))
    return parts


def render(value: str | int | float | bool, tick: Tick) -> str | int | float | bool:
    """The raw parameter value for ``tick`` (typed later by the definition's declaration)."""
    if not isinstance(value, str):
        return value
    shown: list[str] = []
    for part in parse_template(value):
        if part.literal is not None:
            shown.append(part.literal)
        elif part.field == "iso":
            shown.append(tick.iso)
        else:
            shown.append((tick.local_date + dt.timedelta(days=part.days)).isoformat())
    return "".join(shown)


# ---- the model ---------------------------------------------------------------------------------------


class ScheduleSpec(BaseModel):
    """When a definition runs by itself and with which parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cron: str = Field(min_length=1, max_length=CRON_CHARS_MAX)
    timezone: str = Field(default="UTC", min_length=1, max_length=TIMEZONE_CHARS_MAX)
    parameters: dict[str, str | int | float | bool] = Field(default={}, max_length=SCHEDULE_PARAMETERS_MAX)
    overlap: OverlapPolicy = "skip"
    catchup_window: str = CATCHUP_WINDOW_DEFAULT
    enabled: bool = True

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        fields = value.split()
        if len(fields) != 5:
            raise ValueError("cron must have 5 fields: minute hour day-of-month month day-of-week")
        text = " ".join(fields)
        if any(_MOVING_FIELD.match(token) for field in fields for token in field.split(",")):
            # croniter draws R anew at every parse (two ticks for one day) and H from a hash id.
            raise ValueError("cron fields must be fixed: the random (R) and hashed (H) forms are not accepted")
        if not croniter.is_valid(text):
            raise ValueError("cron is not a valid 5-field expression")
        return text

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a folder of zones, such as Europe
            raise ValueError("timezone is not a known IANA time zone name (e.g. Europe/Berlin, UTC)") from None
        return value

    @field_validator("catchup_window")
    @classmethod
    def _window(cls, value: str) -> str:
        parse_window(value)
        return value

    @field_validator("parameters")
    @classmethod
    def _expressions(cls, value: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        for name, item in value.items():
            if isinstance(item, str):
                try:
                    parse_template(item)
                except ValueError as error:
                    raise ValueError(f"parameter {name!r}: {error}") from None
        return value

    @property
    def catchup_window_s(self) -> int:
        return parse_window(self.catchup_window)

    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def check_parameters(self, declared: Mapping[str, Any]) -> None:
        """Every expression names a declared parameter and, rendered for a sample tick, fits its type;
        every required parameter is given. ``declared``: name -> ParameterSpec. ValueError otherwise."""
        sample = Tick(dt.datetime(2026, 1, 15, tzinfo=dt.UTC), dt.date(2026, 1, 15))
        for name, value in self.parameters.items():
            spec = declared.get(name)
            if spec is None:
                names = ", ".join(sorted(declared)) or "none"
                raise ValueError(f"schedule parameter {name!r} is not declared: the definition declares {names}")
            try:
                parameters_mod.coerce(spec.type, render(value, sample))
            except parameters_mod.ParameterValueError as error:
                problem = f"schedule parameter {name!r} is declared {spec.type}; its value does not fit: {error}"
                raise ValueError(problem) from None
        for name, spec in declared.items():
            if spec.default is None and name not in self.parameters:
                raise ValueError(f"parameter {name!r} is required and the schedule does not give it")

    def parameters_for(self, tick: Tick) -> dict[str, str | int | float | bool]:
        return {name: render(value, tick) for name, value in self.parameters.items()}

    # ---- ticks ---------------------------------------------------------------------------------------

    def tick_at(self, instant: dt.datetime) -> Tick:
        return Tick(instant.astimezone(dt.UTC), instant.astimezone(self.zone()).date())

    def ticks(self, after: dt.datetime, until: dt.datetime, limit: int) -> list[Tick]:
        """The ticks in ``(after, until]``, oldest first, at most ``limit``."""
        found: list[Tick] = []
        for instant in self._instants(after):
            if instant > until or len(found) >= limit:
                break
            found.append(self.tick_at(instant))
        return found

    def next_tick(self, after: dt.datetime) -> Tick:
        """The first tick after ``after``."""
        return self.tick_at(next(self._instants(after)))

    def _instants(self, after: dt.datetime) -> Iterator[dt.datetime]:
        """Every tick instant after ``after``, increasing, each once."""
        zone = self.zone()
        after_utc = after.astimezone(dt.UTC)
        wall = after_utc.astimezone(zone).replace(tzinfo=None) - _LOOKBACK
        candidates = croniter(self.cron, wall)
        last: dt.datetime | None = None
        while True:
            instant = instant_of(candidates.get_next(dt.datetime), zone)
            if instant <= after_utc or instant == last:
                continue
            last = instant
            yield instant


def instant_of(wall: dt.datetime, zone: ZoneInfo) -> dt.datetime:
    """The UTC instant of a local wall time: its first occurrence when repeated, the end of the gap
    (the next valid instant) when skipped."""
    naive = wall.replace(tzinfo=None, fold=0)
    first = naive.replace(tzinfo=zone).astimezone(dt.UTC)
    if first.astimezone(zone).replace(tzinfo=None) == naive:
        return first
    # Skipped: fold=1 reads it with the offset after the jump (an instant before the jump), fold=0
    # with the one before (after it). The jump is the first whole second whose wall time is later.
    low = naive.replace(tzinfo=zone, fold=1).astimezone(dt.UTC)
    high = first
    low_s, high_s = int(low.timestamp()), int(high.timestamp())
    for _ in range(_GAP_SEARCH_STEPS_MAX):
        if high_s - low_s <= 1:
            break
        middle = (low_s + high_s) // 2
        if dt.datetime.fromtimestamp(middle, dt.UTC).astimezone(zone).replace(tzinfo=None) > naive:
            high_s = middle
        else:
            low_s = middle
    return dt.datetime.fromtimestamp(high_s, dt.UTC)
