"""Acceptance: bad platform limits (options or DATAFLOW_* variables) and a definition asking for more
than the platform allows exit 2 with a clear message, before anything is recorded."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from durable_dataflow.dataflow.execution import limits
from support.cli import REVENUE_EXAMPLE, Cli, CliResult, make_cli

LIMIT_VARIABLES = frozenset(setting.variable for setting in limits.SETTINGS)
DAY = "day=2026-11-02"


@pytest.fixture
def cli(sqlite_url: str, tmp_path: Path) -> Cli:
    # The limits this test sets are the only ones: none inherited from the caller's environment.
    base = make_cli(sqlite_url, tmp_path)
    return dataclasses.replace(base, env={k: v for k, v in base.env.items() if k not in LIMIT_VARIABLES})


def revenue_with(tmp_path: Path, extra: str = "") -> Path:
    folder = tmp_path / "revenue"
    shutil.copytree(REVENUE_EXAMPLE.parent, folder)
    path = folder / "dataflow.yaml"
    path.write_text(path.read_text() + extra)
    return path


def assert_refused(result: CliResult, *fragments: str) -> None:
    assert result.code == 2, result.output
    assert result.stderr.startswith("error [invalid_input]: "), result.stderr
    assert all(fragment in result.stderr for fragment in fragments), result.stderr
    assert "Traceback" not in result.output and result.stdout == ""


def test_bad_limit_option_or_variable_exits_2_and_records_nothing(cli: Cli, tmp_path: Path) -> None:
    """`run --memory-limit 0` and a bad DATAFLOW_TIME_LIMIT exit 2 naming the option or variable, and
    `dataflow runs` afterwards shows no run (checked through the CLI in subprocesses)."""
    path = revenue_with(tmp_path)
    assert_refused(cli("run", str(path), "--param", DAY, "--memory-limit", "0"), "--memory-limit", "at least 1 MiB")
    bad_variable = cli("run", str(path), "--param", DAY, extra_env={"DATAFLOW_TIME_LIMIT": "soon-canary"})
    assert_refused(bad_variable, "DATAFLOW_TIME_LIMIT", "the duration is not valid")
    assert "soon-canary" not in bad_variable.output
    assert_refused(cli("run", str(path), "--param", DAY, "--threads", "0"), "--threads", "at least 1")
    assert cli("runs", "--json").json() == []


def test_worker_and_serve_take_the_same_limit_options(cli: Cli) -> None:
    """`worker` and `serve` refuse a bad limit option the same way, before they start (exit 2)."""
    assert_refused(cli("worker", "--once", "--result-bytes-max", "2GiB"), "--result-bytes-max", "at most 1 GiB")
    assert_refused(cli("serve", "--port", "0", "--time-limit", "0"), "--time-limit", "must be at least")
    assert_refused(
        cli("worker", "--once", extra_env={"DATAFLOW_TEMP_DIR": "/nonexistent-dataflow-temp"}),
        "DATAFLOW_TEMP_DIR",
        "is not an existing directory",
    )


def test_good_limit_options_run_the_definition(cli: Cli, tmp_path: Path) -> None:
    """`run` with valid limit options (and a definition asking for less) succeeds (exit 0)."""
    path = revenue_with(tmp_path, "limits: {threads: 1, time_limit: 2m, memory: 512MiB}\n")
    result = cli("run", str(path), "--param", DAY, "--threads", "2", "--memory-limit", "1GiB", "--time-limit", "5m",
                 "--json")  # fmt: skip
    assert result.code == 0, result.output
    assert result.json()["status"] == "succeeded"


def test_definition_asking_for_impossible_threads_is_refused_before_recording(cli: Cli, tmp_path: Path) -> None:
    """A definition with `limits: {threads: 9999}` exits 2 naming limits.threads, and `dataflow runs`
    shows nothing recorded."""
    path = revenue_with(tmp_path, "limits: {threads: 9999}\n")
    assert_refused(cli("run", str(path), "--param", DAY), str(path), "limits.threads")
    assert cli("runs", "--json").json() == []
    assert cli("definitions", "list", "--json").json() == []


def test_definition_asking_for_more_than_the_platform_is_refused_before_recording(cli: Cli, tmp_path: Path) -> None:
    """A definition asking for 4 threads on a platform run with `--threads 2` exits 2 naming the limit,
    the platform's ceiling and how to raise it, and `dataflow runs` shows nothing recorded."""
    path = revenue_with(tmp_path, "limits: {threads: 4}\n")
    assert_refused(
        cli("run", str(path), "--param", DAY, "--threads", "2"),
        "limits.threads asks for more than",
        "the platform's 2",
        "--threads or DATAFLOW_THREADS",
    )
    assert cli("runs", "--json").json() == []
