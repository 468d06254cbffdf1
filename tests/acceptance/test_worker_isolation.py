"""`dataflow worker` isolates its DuckDB executions: a run that exceeds the memory bound ends only itself."""

from __future__ import annotations

import json
from pathlib import Path

from support.cli import make_cli

HOG_SQL = "select length(repeat('x', 400000000))::bigint as n"  # one ≈ 800 MiB value memory_limit misses


def _definition(folder: Path, name: str, sql: str) -> Path:
    document = {
        "name": name, "version": 1, "sources": {}, "steps": [{"name": "r", "sql": sql}],
        "output": {"schema": {"n": "int64"}, "max_rows": 1, "max_bytes": "1MiB"},
    }  # fmt: skip
    path = folder / f"{name}.json"
    path.write_text(json.dumps(document))
    return path


def test_a_hog_run_ends_limit_exceeded_and_the_same_worker_runs_the_next(tmp_path: Path, sqlite_url: str) -> None:
    """Submits a run building one 400 MB value, then a trivial run, and drains both with one
    `dataflow worker --until-idle --memory-limit 64MiB` (isolated by default): the hog ends failed /
    limit_exceeded naming the memory limit, the next run succeeds, and the worker exits 0. In process the
    hog succeeded at ~900 MiB RSS in the worker itself."""
    cli = make_cli(sqlite_url, tmp_path)
    hog = cli("submit", str(_definition(tmp_path, "hog", HOG_SQL)), "--json")
    small = cli("submit", str(_definition(tmp_path, "small", "select 5::bigint as n")), "--json")
    assert hog.code == 0 and small.code == 0, hog.output + small.output
    worked = cli("worker", "--until-idle", "--poll-interval", "0.05", "--memory-limit", "64MiB")
    assert worked.code == 0, worked.output
    shown_hog = cli("show", hog.json()["run_id"], "--json").json()
    shown_small = cli("show", small.json()["run_id"], "--json").json()
    assert shown_hog["status"] == "failed", shown_hog
    assert shown_hog["error_code"] == "limit_exceeded", shown_hog
    assert "memory" in shown_hog["error_message"], shown_hog
    assert shown_small["status"] == "succeeded", shown_small
    assert shown_small["row_count"] == 1
