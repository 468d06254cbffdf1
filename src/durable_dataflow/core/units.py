"""Sizes and durations as definitions and platform settings write them, the ceilings both obey, and
instants as the database clock stores them (integer microseconds since the epoch).

Its own module, with no dependency, so that ``dataflow.execution.limits`` (read by every CLI command that
declares the limit options) does not import the definition models (pydantic, PyYAML, pyarrow).
``dataflow.definitions.definitions`` re-exports every name here.
"""

from __future__ import annotations

import datetime as dt
import math
import re

# Result bytes are stored in the platform database, so no definition may ask for more than this;
# a platform may allow less (its result_bytes_max, checked by dataflow.execution.limits.effective).
OUTPUT_BYTES_CEILING = 1024**3
# The most engine threads any platform or definition may name: more is a typo, not a machine.
THREADS_CEILING = 256
# The longest time limit any platform or definition may name: a run holds a lease and an engine for
# all of it, and a week is far beyond any batch job while keeping timers well inside their range.
TIME_LIMIT_S_CEILING = 7 * 24 * 3600.0
# The largest size a platform setting may name (2**53 bytes, 8 PiB: exact in JSON, as definitions'
# sizes are, and far inside the engine's range; DuckDB refuses a memory limit of 2**63 bytes).
SIZE_CEILING = 2**53
US_PER_S = 1_000_000  # database-clock times are integer microseconds since the epoch
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_ONE_US = dt.timedelta(microseconds=1)

_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$")
_SIZE_UNITS = {
    None: 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4,
}  # fmt: skip
_DURATION_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$")
_DURATION_UNITS_S = {None: 1, "s": 1, "m": 60, "h": 3600}


def parse_size(value: int | str) -> int:
    """Bytes in a size written as an int or as '64MiB', '10MB', '512KiB', '2TiB'."""
    if isinstance(value, int):
        return value
    match = _SIZE_PATTERN.match(value)
    if not match:
        raise ValueError("the size is not valid: write e.g. 1048576, '10MB', '512KiB', '64MiB' or '2TiB'")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def parse_duration(value: int | float | str) -> float:
    """Seconds in a duration written as a number of seconds or as '90s', '10m', '2h', '1.5h'."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or a string such as '90s', '10m' or '2h'")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an int past float's range
            raise ValueError("a duration must be a finite number of seconds") from None
    else:
        match = _DURATION_PATTERN.match(value)
        if not match:
            raise ValueError("the duration is not valid: write seconds (e.g. 90) or '90s', '10m' or '2h'")
        seconds = float(match.group(1)) * _DURATION_UNITS_S[match.group(2)]
    if not math.isfinite(seconds):
        raise ValueError("a duration must be a finite number of seconds")
    return seconds


def to_us(moment: dt.datetime) -> int:
    """The instant in integer microseconds since the epoch (a naive time is UTC), exactly: through
    ``timedelta`` arithmetic, not a float timestamp, which loses microseconds far from 1970 and
    rounds a fractional second before 1970 the wrong way."""
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
    return (aware - EPOCH) // _ONE_US


def from_us(us: int) -> dt.datetime:
    """The UTC instant of integer microseconds since the epoch, exactly (the inverse of ``to_us``)."""
    return EPOCH + dt.timedelta(microseconds=us)
