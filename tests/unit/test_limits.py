"""Platform limits: read from DATAFLOW_* variables and options (`from_env`), narrowed by a definition
(`effective`), and the settings table that the CLI options and the docs are built from."""

from __future__ import annotations

from pathlib import Path

import pytest

from durable_dataflow.core import units
from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions import definitions
from durable_dataflow.dataflow.definitions.definitions import DefinitionLimits
from durable_dataflow.dataflow.execution import limits
from durable_dataflow.dataflow.execution.limits import ExecutionLimits, GiB, MiB, TiB

REPO_ROOT = Path(__file__).resolve().parents[2]
PLATFORM = ExecutionLimits(
    time_limit_s=600.0, memory_bytes_max=4 * GiB, threads=8, temp_dir=None, temp_bytes_max=100 * GiB,
    source_bytes_max=TiB, result_bytes_max=256 * MiB,
)  # fmt: skip


# --- from_env ------------------------------------------------------------------------------------


def test_from_env_without_variables_gives_the_defaults() -> None:
    """Proves an empty environment (and blank variables) give ExecutionLimits() exactly."""
    assert limits.from_env({}) == ExecutionLimits()
    blank = {setting.variable: "  " for setting in limits.SETTINGS}
    assert limits.from_env(blank) == ExecutionLimits()


@pytest.mark.parametrize(
    ("variable", "raw", "field", "value"),
    [
        ("DATAFLOW_TIME_LIMIT", "90", "time_limit_s", 90.0),
        ("DATAFLOW_TIME_LIMIT", "2.5", "time_limit_s", 2.5),
        ("DATAFLOW_TIME_LIMIT", "10m", "time_limit_s", 600.0),
        ("DATAFLOW_TIME_LIMIT", " 2h ", "time_limit_s", 7200.0),
        ("DATAFLOW_MEMORY_LIMIT", "2GiB", "memory_bytes_max", 2 * GiB),
        ("DATAFLOW_MEMORY_LIMIT", "8GB", "memory_bytes_max", 8 * 1000**3),
        ("DATAFLOW_THREADS", "3", "threads", 3),
        ("DATAFLOW_TEMP_MAX", "1TiB", "temp_bytes_max", TiB),
        ("DATAFLOW_SOURCE_BYTES_MAX", "500GB", "source_bytes_max", 500 * 1000**3),
        ("DATAFLOW_RESULT_BYTES_MAX", "64MiB", "result_bytes_max", 64 * MiB),
        ("DATAFLOW_RESULT_BYTES_MAX", "1GiB", "result_bytes_max", GiB),
    ],
)
def test_from_env_reads_each_variable(variable: str, raw: str, field: str, value: object) -> None:
    """Proves each DATAFLOW_* variable sets its one field (in seconds or bytes) and nothing else."""
    read = limits.from_env({variable: raw})
    assert getattr(read, field) == value
    others = {s.field for s in limits.SETTINGS} - {field}
    assert all(getattr(read, name) == getattr(ExecutionLimits(), name) for name in others)


def test_from_env_reads_the_temp_dir(tmp_path: Path) -> None:
    """Proves DATAFLOW_TEMP_DIR names an existing directory, and a file or a missing path is refused."""
    assert limits.from_env({"DATAFLOW_TEMP_DIR": str(tmp_path)}).temp_dir == tmp_path
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(InputError, match=r"^DATAFLOW_TEMP_DIR: .* is not an existing directory"):
            limits.from_env({"DATAFLOW_TEMP_DIR": str(bad)})


@pytest.mark.parametrize(
    ("variable", "raw", "expected"),
    [
        ("DATAFLOW_TIME_LIMIT", "soon", r"^DATAFLOW_TIME_LIMIT: the duration is not valid"),
        ("DATAFLOW_TIME_LIMIT", "0", r"^DATAFLOW_TIME_LIMIT \(wall-clock time .*\) must be at least"),
        ("DATAFLOW_TIME_LIMIT", "8d", r"^DATAFLOW_TIME_LIMIT: the duration is not valid"),
        ("DATAFLOW_TIME_LIMIT", "200h", r"^DATAFLOW_TIME_LIMIT .* at most 604800 s; got 720000 s"),
        ("DATAFLOW_MEMORY_LIMIT", "0", r"^DATAFLOW_MEMORY_LIMIT .* at least 1 MiB and at most 8192 TiB; got 0 bytes"),
        ("DATAFLOW_MEMORY_LIMIT", "-1GiB", r"^DATAFLOW_MEMORY_LIMIT: the size is not valid"),
        ("DATAFLOW_MEMORY_LIMIT", "4G", r"^DATAFLOW_MEMORY_LIMIT: the size is not valid"),
        ("DATAFLOW_THREADS", "0", r"^DATAFLOW_THREADS .* must be at least 1 and at most 256; got 0"),
        ("DATAFLOW_THREADS", "257", r"^DATAFLOW_THREADS .* at most 256; got 257"),
        ("DATAFLOW_THREADS", "two", r"^DATAFLOW_THREADS: expected a whole number, got 'two'"),
        ("DATAFLOW_THREADS", "1.5", r"^DATAFLOW_THREADS: expected a whole number"),
        ("DATAFLOW_TEMP_MAX", "10KiB", r"^DATAFLOW_TEMP_MAX .* at least 1 MiB and at most 8192 TiB; got 10 KiB"),
        ("DATAFLOW_SOURCE_BYTES_MAX", "0", r"^DATAFLOW_SOURCE_BYTES_MAX .* 1 byte and at most 8192 TiB; got 0 bytes"),
        ("DATAFLOW_RESULT_BYTES_MAX", "2GiB", r"^DATAFLOW_RESULT_BYTES_MAX .* at most 1 GiB; got 2 GiB"),
        # DuckDB refused a memory limit of 2**63 bytes at every execution (worker and serve started).
        ("DATAFLOW_MEMORY_LIMIT", "8388608TiB", r"^DATAFLOW_MEMORY_LIMIT .* at most 8192 TiB; got 8388608 TiB"),
        ("DATAFLOW_TEMP_MAX", "9999999TiB", r"^DATAFLOW_TEMP_MAX .* at most 8192 TiB"),
        ("DATAFLOW_SOURCE_BYTES_MAX", "9999999TiB", r"^DATAFLOW_SOURCE_BYTES_MAX .* at most 8192 TiB"),
        ("DATAFLOW_TIME_LIMIT", "9" * 400, r"^DATAFLOW_TIME_LIMIT: a duration must be a finite number"),
        ("DATAFLOW_TEMP_DIR", "~no-such-user-3f1a/x", r"^DATAFLOW_TEMP_DIR: a path starting with ~ names a home"),
    ],
)
def test_from_env_refuses_bad_values_naming_the_variable(variable: str, raw: str, expected: str) -> None:
    """Proves a bad or out-of-range value is an InputError that starts with the variable's name."""
    with pytest.raises(InputError, match=expected):
        limits.from_env({variable: raw})


def test_from_env_errors_never_show_other_variables() -> None:
    """Proves the message about one bad variable carries no other variable's value (a canary)."""
    environ = {"DATAFLOW_THREADS": "x", "DATAFLOW_MEMORY_LIMIT": "2GiB", "CANARY_SECRET": "canary-93f1"}
    with pytest.raises(InputError) as caught:
        limits.from_env(environ)
    assert "canary" not in caught.value.message and "2GiB" not in caught.value.message


def test_overrides_win_over_the_environment_and_are_named_in_errors(tmp_path: Path) -> None:
    """Proves a given override (CLI option) beats its variable, None falls back to the variable, typed
    values work like text, and a bad override is named by its option, not by the variable."""
    environ = {"DATAFLOW_THREADS": "6", "DATAFLOW_MEMORY_LIMIT": "2GiB", "DATAFLOW_TIME_LIMIT": "bad"}
    read = limits.from_env(environ, threads="2", memory_bytes_max=None, time_limit_s=30, temp_dir=tmp_path)
    assert (read.threads, read.memory_bytes_max, read.time_limit_s, read.temp_dir) == (2, 2 * GiB, 30.0, tmp_path)
    assert limits.from_env({}, result_bytes_max="1MiB", source_bytes_max=10, threads=1).result_bytes_max == MiB
    with pytest.raises(InputError, match=r"^--memory-limit .* at least 1 MiB and at most 8192 TiB; got 0 bytes"):
        limits.from_env(environ, memory_bytes_max="0", time_limit_s=1)
    with pytest.raises(InputError, match=r"^--threads: expected a whole number, not true/false"):
        limits.from_env({}, threads=True)


# --- effective -----------------------------------------------------------------------------------


def test_effective_without_a_block_only_narrows_the_result_bytes() -> None:
    """Proves a definition without limits runs with the platform's limits, result_bytes_max set to its
    output.max_bytes."""
    assert limits.effective(PLATFORM, None, 64 * 1024) == ExecutionLimits(
        time_limit_s=600.0, memory_bytes_max=4 * GiB, threads=8, temp_dir=None, temp_bytes_max=100 * GiB,
        source_bytes_max=TiB, result_bytes_max=64 * 1024,
    )  # fmt: skip


def test_effective_narrows_by_what_the_definition_asks() -> None:
    """Proves each asked limit replaces the platform's when lower or equal; the rest stay the platform's."""
    asked = DefinitionLimits(time_limit="90s", memory="1GiB", threads=8, source_bytes_max="10GB")
    narrowed = limits.effective(PLATFORM, asked, 256 * MiB)
    assert (narrowed.time_limit_s, narrowed.memory_bytes_max, narrowed.threads) == (90.0, GiB, 8)
    assert (narrowed.source_bytes_max, narrowed.result_bytes_max) == (10**10, 256 * MiB)
    assert (narrowed.temp_dir, narrowed.temp_bytes_max) == (PLATFORM.temp_dir, PLATFORM.temp_bytes_max)
    only_threads = limits.effective(PLATFORM, DefinitionLimits(threads=1), 1)
    assert only_threads.threads == 1 and only_threads.memory_bytes_max == PLATFORM.memory_bytes_max


@pytest.mark.parametrize(
    ("asked", "output_bytes_max", "expected"),
    [
        (
            DefinitionLimits(threads=9),
            1,
            r"limits\.threads asks for more than the platform's 8 .* "
            r"--threads or DATAFLOW_THREADS",
        ),
        (
            DefinitionLimits(memory="8GiB"),
            1,
            r"limits\.memory asks for more than the platform's 4 GiB .* "
            r"--memory-limit or DATAFLOW_MEMORY_LIMIT",
        ),
        (
            DefinitionLimits(time_limit="2h"),
            1,
            r"limits\.time_limit asks for more than the platform's "
            r"600 s .* --time-limit or DATAFLOW_TIME_LIMIT",
        ),
        (
            DefinitionLimits(source_bytes_max="2TiB"),
            1,
            r"limits\.source_bytes_max asks for more than the "
            r"platform's 1 TiB .* --source-bytes-max or DATAFLOW_SOURCE_BYTES_MAX",
        ),
        (
            None,
            512 * MiB,
            r"output\.max_bytes asks for more than the platform's 256 MiB "
            r"\(ceiling of output\.max_bytes\).* --result-bytes-max or DATAFLOW_RESULT_BYTES_MAX",
        ),
    ],
)
def test_effective_refuses_asking_for_more_naming_the_ceiling(
    asked: DefinitionLimits | None, output_bytes_max: int, expected: str
) -> None:
    """Proves asking above the platform is an InputError naming the field, the platform's ceiling and
    the option and variable that raise it, but not the value asked (the submitter's input)."""
    with pytest.raises(InputError, match=expected):
        limits.effective(PLATFORM, asked, output_bytes_max)


def test_effective_names_every_limit_asked_too_high() -> None:
    """Proves one refusal lists every excess at once, so the author fixes them in one edit."""
    with pytest.raises(InputError) as caught:
        limits.effective(PLATFORM, DefinitionLimits(threads=16, memory="1TiB"), GiB)
    message = caught.value.message
    assert message.startswith("the definition asks for more than this platform allows: ")
    assert "limits.threads" in message and "limits.memory" in message and "output.max_bytes" in message


def test_effective_of_a_parsed_definition() -> None:
    """Proves the call the run service makes, on a parsed definition, narrows as its block says."""
    text = (REPO_ROOT / "examples" / "revenue_by_region" / "dataflow.yaml").read_text()
    d = definitions.parse_definition(text + "limits: {threads: 2, time_limit: 1m}\n", "flow.yaml")
    narrowed = limits.effective(PLATFORM, d.limits, d.output.max_bytes_int)
    assert (narrowed.threads, narrowed.time_limit_s, narrowed.result_bytes_max) == (2, 60.0, d.output.max_bytes_int)


# --- the settings table --------------------------------------------------------------------------


def test_settings_cover_every_field_and_their_default_texts_are_true() -> None:
    """Proves the table names each ExecutionLimits field once with a DATAFLOW_ variable and an option,
    and each written default parses to the dataclass default (so help texts and docs cannot drift)."""
    fields = [s.field for s in limits.SETTINGS]
    assert sorted(fields) == sorted(ExecutionLimits.__dataclass_fields__) and len(set(fields)) == len(fields)
    defaults = ExecutionLimits()
    for setting in limits.SETTINGS:
        assert setting.variable.startswith("DATAFLOW_") and setting.option.startswith("--")
        if setting.kind is limits.SettingKind.DURATION:
            assert definitions.parse_duration(setting.default_text) == getattr(defaults, setting.field)
        elif setting.kind is limits.SettingKind.SIZE and getattr(defaults, setting.field) is None:
            assert "free disk space" in setting.default_text  # sized as each execution starts
        elif setting.kind is limits.SettingKind.SIZE:
            assert definitions.parse_size(setting.default_text) == getattr(defaults, setting.field)
    assert defaults.threads in range(1, limits.THREADS_MAX_DEFAULT + 1)


def test_every_setting_is_documented() -> None:
    """Proves docs/deployment.md's Limits table and docs/cli.md name every option and variable."""
    deployment = (REPO_ROOT / "docs" / "deployment.md").read_text().split("## Limits", 1)[1]
    cli = (REPO_ROOT / "docs" / "cli.md").read_text()
    for setting in limits.SETTINGS:
        assert f"`{setting.option} " in deployment and f"`{setting.variable}`" in deployment, setting.field
        assert f"`{setting.option} " in cli, setting.field


def test_a_duration_past_floats_range_is_refused_not_an_overflow() -> None:
    """Proves a definition's time_limit written as a 400-digit integer is an InputError (float() of it
    raised OverflowError, an internal error), like any duration that is not finite."""
    with pytest.raises(ValueError, match="a duration must be a finite number of seconds"):
        units.parse_duration(10**400)
