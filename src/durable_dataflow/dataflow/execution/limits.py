"""Platform-wide execution limits, and the narrower limits a definition may ask for.

The platform (``dataflow run``, ``worker`` and ``serve``, through options or ``DATAFLOW_*``
variables) sets the ceiling; a definition's ``limits:`` block may ask for less, never more. The
defaults are sized for real tables on a shared server: the engine streams sources and spills to a
private folder of each execution, so memory bounds the working set, not the data.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from durable_dataflow.core import units
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.invariants import invariant

if TYPE_CHECKING:  # the definition models (pydantic, PyYAML, pyarrow) are not needed to read settings
    from durable_dataflow.dataflow.definitions.definitions import DefinitionLimits

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
# Where the Spark engine runs (docs/deployment.md): platform settings, not limits, kept here because
# the same commands take them; the CLI's --spark-* options set the variables for their process.
SPARK_MASTER_ENV = "DATAFLOW_SPARK_MASTER"  # e.g. local[2] (the default) or spark://host:7077
SPARK_REMOTE_ENV = "DATAFLOW_SPARK_REMOTE"  # a Spark Connect URL, sc://host:15002; wins over the master
SPARK_CONF_ENV = "DATAFLOW_SPARK_CONF"  # key=value pairs separated by ';' or newlines
TIME_LIMIT_S_DEFAULT = 3600.0
MEMORY_BYTES_MAX_DEFAULT = 4 * GiB
THREADS_MAX_DEFAULT = 8
TEMP_BYTES_MAX_DEFAULT = 100 * GiB  # the most an execution may spill unless the operator sets --temp-max
# Without --temp-max, an execution may spill at most this share of the free space its spill folder's
# file system has when it starts (and never more than TEMP_BYTES_MAX_DEFAULT): a default that fits the
# disk, so that a few executions spilling at once leave room for the platform database beside them.
TEMP_FREE_SPACE_DIVISOR = 4
# The folder executions spill into (each in a private folder of its own) under the platform's data directory.
SPILL_FOLDER_NAME = "spill"
SOURCE_BYTES_MAX_DEFAULT = 1024 * GiB
RESULT_BYTES_MAX_DEFAULT = 1 * GiB


def _threads_default() -> int:
    return max(1, min(os.cpu_count() or 1, THREADS_MAX_DEFAULT))


@dataclass(frozen=True)
class ExecutionLimits:
    """Bounds of one execution.

    ``memory_bytes_max`` and ``threads`` configure the engine; ``temp_dir`` is where the engine
    spills (each execution gets a private folder inside it, removed afterwards; a platform without
    --temp-dir uses spill/ in its data directory, ``with_data_dir``; None means the system temporary
    directory) and ``temp_bytes_max`` bounds what it may spill (None: a quarter of the free space of
    the spill folder's file system when the execution starts, at most 100 GiB; ``spill_bytes_max``).
    ``source_bytes_max`` bounds the bytes each source may read (the sizes of its files on disk, or
    the Arrow bytes streamed from PostgreSQL); ``result_bytes_max`` is the ceiling of ``output.max_bytes``.
    """

    time_limit_s: float = TIME_LIMIT_S_DEFAULT
    memory_bytes_max: int = MEMORY_BYTES_MAX_DEFAULT
    threads: int = field(default_factory=_threads_default)
    temp_dir: Path | None = None
    temp_bytes_max: int | None = None
    source_bytes_max: int = SOURCE_BYTES_MAX_DEFAULT
    result_bytes_max: int = RESULT_BYTES_MAX_DEFAULT

    @property
    def memory_limit(self) -> str:
        """memory_bytes_max as a DuckDB setting value."""
        return f"{max(1, self.memory_bytes_max // 1024**2)}MiB"


# ---- the settings: one table for the options, the variables, their ranges and their messages -----

# The engine's memory and spill settings have MiB granularity; a smaller value would be rounded up.
MEMORY_BYTES_MIN = 1 * MiB
TEMP_BYTES_MIN = 1 * MiB
TIME_LIMIT_S_MIN = 0.001
# A raw value shown back in an error message is cut to this many characters.
RAW_VALUE_CHARS_SHOWN_MAX = 60

Raw = str | int | float | Path
Override = Raw | None


class SettingKind(enum.Enum):
    DURATION = "a duration"  # seconds as a number, or "90s", "10m", "2h" (units.parse_duration)
    SIZE = "a size"  # bytes as a number, or "512MiB", "2GiB", "1TiB" (units.parse_size)
    COUNT = "a whole number"  # threads
    DIRECTORY = "a directory"  # an existing directory


# How a value of each kind is written, for help texts.
KIND_FORMS = {
    SettingKind.DURATION: "seconds, or e.g. 90s, 10m, 2h",
    SettingKind.SIZE: "bytes, or e.g. 512MiB, 4GiB, 1TiB",
    SettingKind.COUNT: f"1 to {units.THREADS_CEILING}",
    SettingKind.DIRECTORY: "an existing directory",
}


@dataclass(frozen=True)
class Setting:
    """One platform limit: the ExecutionLimits field it sets, its option, its variable, its range."""

    field: str
    option: str  # of `dataflow run`, `worker` and `serve`
    variable: str
    kind: SettingKind
    meaning: str
    default_text: str
    minimum: float = 0
    maximum: float | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting("time_limit_s", "--time-limit", "DATAFLOW_TIME_LIMIT", SettingKind.DURATION,
            "wall-clock time of one execution", "1h", TIME_LIMIT_S_MIN, units.TIME_LIMIT_S_CEILING),
    Setting("memory_bytes_max", "--memory-limit", "DATAFLOW_MEMORY_LIMIT", SettingKind.SIZE,
            "engine memory of one execution", "4GiB", MEMORY_BYTES_MIN, units.SIZE_CEILING),
    Setting("threads", "--threads", "DATAFLOW_THREADS", SettingKind.COUNT,
            "engine threads of one execution", "the CPU count, at most 8", 1, units.THREADS_CEILING),
    Setting("temp_dir", "--temp-dir", "DATAFLOW_TEMP_DIR", SettingKind.DIRECTORY,
            "folder executions spill to (each in a private subfolder)",
            "spill/ in the platform's data directory, else the system temporary directory"),
    Setting("temp_bytes_max", "--temp-max", "DATAFLOW_TEMP_MAX", SettingKind.SIZE,
            "spilled bytes of one execution", "a quarter of the free disk space, at most 100GiB", TEMP_BYTES_MIN,
            units.SIZE_CEILING),
    Setting("source_bytes_max", "--source-bytes-max", "DATAFLOW_SOURCE_BYTES_MAX", SettingKind.SIZE,
            "bytes one source may read", "1TiB", 1, units.SIZE_CEILING),
    Setting("result_bytes_max", "--result-bytes-max", "DATAFLOW_RESULT_BYTES_MAX", SettingKind.SIZE,
            "ceiling of output.max_bytes", "1GiB", 1, units.OUTPUT_BYTES_CEILING),
)  # fmt: skip
SETTING_BY_FIELD: Mapping[str, Setting] = {s.field: s for s in SETTINGS}
# Where each narrowing request is written in a definition document, for messages.
_ASKED_FIELD = {
    "time_limit_s": "limits.time_limit",
    "memory_bytes_max": "limits.memory",
    "threads": "limits.threads",
    "source_bytes_max": "limits.source_bytes_max",
    "result_bytes_max": "output.max_bytes",
}


def format_size(size: int) -> str:
    """A size as people write it: '4 GiB' when a binary unit divides it, else the bytes."""
    for unit, name in ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return "1 byte" if size == 1 else f"{size} bytes"


def format_value(setting: Setting, value: float | int) -> str:
    """A number-valued setting's value in its unit, for messages."""
    if setting.kind is SettingKind.DURATION:
        return f"{float(value):g} s"
    if setting.kind is SettingKind.SIZE:
        return format_size(int(value))
    return str(value)


# ---- the platform's limits: environment and options ---------------------------------------------


def from_env(
    environ: Mapping[str, str] = os.environ,
    *,
    time_limit_s: Override = None,
    memory_bytes_max: Override = None,
    threads: Override = None,
    temp_dir: Override = None,
    temp_bytes_max: Override = None,
    source_bytes_max: Override = None,
    result_bytes_max: Override = None,
) -> ExecutionLimits:
    """The platform's limits: each override (a CLI option; None = not given), else its DATAFLOW_*
    variable, else the default. Text is parsed as the variable would be; a bad value raises
    InputError naming the option or variable it came from (and no other variable's value)."""
    overrides: dict[str, Override] = {
        "time_limit_s": time_limit_s, "memory_bytes_max": memory_bytes_max, "threads": threads,
        "temp_dir": temp_dir, "temp_bytes_max": temp_bytes_max, "source_bytes_max": source_bytes_max,
        "result_bytes_max": result_bytes_max,
    }  # fmt: skip
    invariant(set(overrides) == set(SETTING_BY_FIELD), "from_env names every setting once")
    chosen: dict[str, object] = {}
    for setting in SETTINGS:
        given = _given(setting, environ, overrides[setting.field])
        if given is not None:
            origin, raw = given
            chosen[setting.field] = _parse(setting, origin, raw)
    return ExecutionLimits(**chosen)  # type: ignore[arg-type]  # each value parsed for its field


def _given(setting: Setting, environ: Mapping[str, str], override: Override) -> tuple[str, Raw] | None:
    """Where the setting's value comes from (the option, else the variable), or None for the default."""
    if override is not None:
        return setting.option, override
    raw = environ.get(setting.variable, "")
    return (setting.variable, raw) if raw.strip() else None


def _parse(setting: Setting, origin: str, raw: Raw) -> float | int | Path:
    """The typed, range-checked value of one setting; InputError naming origin otherwise."""
    try:
        value = _typed(setting, raw)
    except ValueError as error:
        raise InputError(f"{origin}: {error}") from None
    if isinstance(value, Path):
        if not value.is_dir():
            raise InputError(f"{origin}: {value} is not an existing directory")
        return value
    too_low = value < setting.minimum
    too_high = setting.maximum is not None and value > setting.maximum
    if too_low or too_high:
        high = "" if setting.maximum is None else f" and at most {format_value(setting, setting.maximum)}"
        raise InputError(
            f"{origin} ({setting.meaning}) must be at least {format_value(setting, setting.minimum)}{high}; "
            f"got {format_value(setting, value)}"
        )
    return value


def _typed(setting: Setting, raw: Raw) -> float | int | Path:
    if isinstance(raw, bool):
        raise ValueError(f"expected {setting.kind.value}, not true/false")
    if setting.kind is SettingKind.DIRECTORY:
        text = str(raw)
        if "\x00" in text:
            raise ValueError("a path cannot contain a NUL character")
        try:
            return Path(text).expanduser()
        except RuntimeError:  # ~user of no such user, or no home directory to expand ~ to
            raise ValueError("a path starting with ~ names a home directory that does not exist") from None
    if isinstance(raw, Path):
        raise ValueError(f"expected {setting.kind.value}, not a path")
    if setting.kind is SettingKind.DURATION:
        return units.parse_duration(raw.strip() if isinstance(raw, str) else raw)
    if setting.kind is SettingKind.SIZE:
        if isinstance(raw, float):
            raise ValueError(f"size {raw!r} is not valid: write a whole number of bytes or e.g. '512MiB', '4GiB'")
        return units.parse_size(raw)
    if isinstance(raw, float) or (isinstance(raw, str) and not raw.strip().isdigit()):
        raise ValueError(f"expected a whole number, got {_shown_raw(raw)}")
    return int(raw)


def _shown_raw(raw: Raw) -> str:
    text = repr(str(raw))
    return text if len(text) <= RAW_VALUE_CHARS_SHOWN_MAX else text[: RAW_VALUE_CHARS_SHOWN_MAX - 1] + "…"


# ---- where one execution spills, and how much ----------------------------------------------------


def with_data_dir(platform: ExecutionLimits, database_files: tuple[Path, ...]) -> ExecutionLimits:
    """The platform's limits spilling under its data directory: without --temp-dir, ``spill/`` in the
    folder of its database's first file (a SQLite file), made private (mode 0700) when missing.
    Unchanged when --temp-dir is set, when the database has no file on this host (PostgreSQL) and when
    the folder cannot be made (a read-only data directory): executions then spill where they did."""
    if platform.temp_dir is not None or not database_files:
        return platform
    folder = database_files[0].parent / SPILL_FOLDER_NAME
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return platform
    return dataclasses.replace(platform, temp_dir=folder)


def spill_bytes_max(bounds: ExecutionLimits, free_bytes: int) -> int:
    """What one execution may spill: --temp-max when set, else a quarter of ``free_bytes`` (the free
    space of the spill folder's file system as the execution starts), at most 100 GiB and at least
    the engine's 1 MiB granularity."""
    if bounds.temp_bytes_max is not None:
        return bounds.temp_bytes_max
    invariant(free_bytes >= 0, "free disk space is never negative")
    sized = max(TEMP_BYTES_MIN, min(TEMP_BYTES_MAX_DEFAULT, free_bytes // TEMP_FREE_SPACE_DIVISOR))
    invariant(TEMP_BYTES_MIN <= sized <= TEMP_BYTES_MAX_DEFAULT, "the default spill cap stays in its range")
    return sized


# ---- what one execution may use ------------------------------------------------------------------


def effective(platform: ExecutionLimits, asked: DefinitionLimits | None, output_bytes_max: int) -> ExecutionLimits:
    """The platform's limits narrowed by what a definition asks for (its ``limits:`` block and its
    ``output.max_bytes``, which becomes result_bytes_max). Asking for more than the platform allows
    raises InputError naming each such limit, the platform's ceiling and the option and variable
    that raise it; the caller refuses the run before recording anything."""
    requested: dict[str, float | int] = dict(asked.requested()) if asked is not None else {}
    requested["result_bytes_max"] = output_bytes_max
    refusals = [
        _refusal(SETTING_BY_FIELD[name], getattr(platform, name))
        for name, value in requested.items()
        if value > getattr(platform, name)
    ]
    if refusals:
        raise InputError("the definition asks for more than this platform allows: " + "; ".join(refusals))
    narrowed = dataclasses.replace(platform, **requested)  # type: ignore[arg-type]  # values typed by requested()
    invariant(
        all(getattr(narrowed, name) <= getattr(platform, name) for name in requested),
        "effective limits never exceed the platform's",
    )
    return narrowed


def _refusal(setting: Setting, ceiling: float | int) -> str:
    # Names the field and the platform's ceiling, not the value asked: the definition is the
    # submitter's input, and an API answer never echoes input (docs/api.md).
    return (
        f"{_ASKED_FIELD[setting.field]} asks for more than the platform's "
        f"{format_value(setting, ceiling)} ({setting.meaning}); ask for less, or have the platform operator "
        f"raise it with {setting.option} or {setting.variable}"
    )
