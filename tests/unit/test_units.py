"""dataflow.units: instants to and from database-clock microseconds, exactly."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st

from durable_dataflow.core import units

AWARE = st.datetimes(
    min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30), timezones=st.timezones(),
    allow_imaginary=False,  # a wall time inside a DST gap names no instant
)


@given(AWARE)
def test_an_instant_survives_microseconds_exactly(moment: dt.datetime) -> None:
    """Proves to_us and from_us are exact inverses for every aware instant of the calendar, and that
    to_us counts whole microseconds from the epoch (a float timestamp is off far from 1970)."""
    us = units.to_us(moment)
    # Compared in UTC: Python never finds an ambiguous wall time equal to a time in another zone.
    assert units.from_us(us) == moment.astimezone(dt.UTC)
    assert us == (moment - units.EPOCH) // dt.timedelta(microseconds=1)


def test_the_float_timestamp_cases_that_went_wrong() -> None:
    """Proves the cases a float timestamp got wrong: a fractional second before 1970 (int() rounds
    towards zero) and the last microsecond of a second far from 1970 (the float rounds up)."""
    before_1970 = dt.datetime(1969, 12, 31, 23, 59, 59, 500_000, tzinfo=dt.UTC)
    assert units.to_us(before_1970) == -500_000
    far = dt.datetime(2999, 12, 31, 23, 59, 59, 999_999, tzinfo=dt.UTC)
    assert units.to_us(far) % units.US_PER_S == 999_999
    assert units.from_us(units.to_us(far)) == far
    assert units.to_us(dt.datetime(2026, 3, 29, 1, 0)) == units.to_us(dt.datetime(2026, 3, 29, 1, 0, tzinfo=dt.UTC))
