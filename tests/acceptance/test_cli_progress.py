"""Acceptance: `dataflow run` on a terminal draws a live progress line (phase, engine progress, rows,
bytes); in a pipe and with --json the output carries no progress at all."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support.cli import CLI_TIMEOUT_S, make_cli

# About two seconds of engine work over a Parquet source, so several progress reports are drawn.
SLOW_DEFINITION = """
name: slow_count
version: 1
sources:
  facts: {kind: parquet, path: facts.parquet}
steps:
  - name: counted
    sql: select count(distinct md5(f.n::varchar || r.a::varchar)) as c from facts f, range(8) r(a)
output:
  schema: {c: int64}
  max_rows: 1
  max_bytes: 1MiB
"""


@pytest.fixture
def flow(tmp_path: Path) -> Path:
    pq.write_table(pa.table({"n": pa.array(range(200_000), pa.int64())}), tmp_path / "facts.parquet")
    path = tmp_path / "slow.yaml"
    path.write_text(SLOW_DEFINITION)
    return path


def _run_on_a_terminal(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run argv with stdout and stderr on a pseudo-terminal; returns the exit code and what it drew."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    drawn = bytearray()
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while time.monotonic() < deadline:  # ends when the terminal closes (the process exited)
        ready, _, _ = select.select([leader], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        drawn.extend(chunk)
    os.close(leader)
    return process.wait(timeout=CLI_TIMEOUT_S), drawn.decode("utf-8", "replace")


def test_run_on_a_terminal_shows_the_phase_and_progress(sqlite_url: str, tmp_path: Path, flow: Path) -> None:
    """Proves the progress line reaches a terminal: the definition's name and the executing phase."""
    cli = make_cli(sqlite_url, tmp_path)
    env = {**cli.env, "TERM": "xterm-256color", "COLUMNS": "160"}
    argv = [sys.executable, "-m", "durable_dataflow.cli", "--db", sqlite_url, "run", str(flow)]
    code, drawn = _run_on_a_terminal(argv, tmp_path, env)
    assert code == 0, drawn
    assert "slow_count: executing" in drawn
    assert "succeeded" in drawn


def test_run_in_a_pipe_and_as_json_prints_no_progress(sqlite_url: str, tmp_path: Path, flow: Path) -> None:
    """Proves non-terminal output stays clean: no progress text on stderr, and --json stdout is one document."""
    cli = make_cli(sqlite_url, tmp_path)
    plain = cli("run", str(flow))
    assert plain.code == 0, plain.output
    assert "executing" not in plain.output and plain.stderr == ""
    as_json = cli("run", str(flow), "--json")
    assert as_json.code == 0 and json.loads(as_json.stdout)["status"] == "succeeded"
    assert "executing" not in as_json.stderr
