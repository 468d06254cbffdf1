"""Acceptance: forward-recovery runs from the CLI — a publication to the Parquet folder, and an unresolved
run (crash after the dispatch authorization) that every view warns about and `reconcile` settles."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from durable_dataflow.core.db import Database
from durable_dataflow.dataflow.protocol import sweeper
from support.cli import PUBLISH_EXAMPLE, Cli, make_cli

DAY = "2026-11-02"
KEY = "publish-2026-11-02"
LEASE_EXPIRY_SHIFT_S = 3600  # far beyond any lease TTL: the crashed attempt's lease is expired


@pytest.fixture
def publish_definition(tmp_path: Path) -> Path:
    folder = tmp_path / "daily_orders_publish"
    shutil.copytree(PUBLISH_EXAMPLE, folder)
    shutil.rmtree(folder / "warehouse", ignore_errors=True)
    return folder / "dataflow.yaml"


@pytest.fixture
def sqlite_cli(sqlite_url: str, tmp_path: Path) -> Cli:
    return make_cli(sqlite_url, tmp_path)


def published_rows(definition: Path) -> int:
    files = list((definition.parent / "warehouse" / "daily_revenue" / "data").glob("*.parquet"))
    return sum(pq.read_table(f).num_rows for f in files)


def test_forward_run_publishes_to_parquet_folder(sqlite_cli: Cli, publish_definition: Path) -> None:
    """A forward-recovery run exits 0, its JSON carries the publication key and refs, and the Parquet folder
    holds exactly its rows; a replay publishes nothing more."""
    result = sqlite_cli("run", str(publish_definition), "--param", f"day={DAY}", "--idempotency-key", KEY, "--json")
    assert result.code == 0, result.output
    run = result.json()
    assert run["mode"] == "forward_recovery" and run["status"] == "succeeded"
    for field in ("publication_idempotency_key", "publication_ref", "materialization_ref", "datasource_ref"):
        assert run[field], f"{field} is empty"
    assert run["row_count"] > 0 and published_rows(publish_definition) == run["row_count"]

    replay = sqlite_cli("run", str(publish_definition), "--param", f"day={DAY}", "--idempotency-key", KEY, "--json")
    assert replay.code == 0 and replay.json()["replayed"] is True
    assert published_rows(publish_definition) == run["row_count"]
    assert sqlite_cli("verify", run["run_id"]).code == 0


def test_unresolved_run_is_warned_everywhere_and_reconciled(
    sqlite_cli: Cli, sqlite_url: str, publish_definition: Path
) -> None:
    """A CLI run killed right after its dispatch authorization is swept to outcome_unknown; `runs`, `runs --json`,
    a replay (exit 3) and `show` carry the warning and never say 'failed'; `reconcile` proves it absent (exit 0)
    and `reconcile --resume` publishes the stored result once (exit 0)."""
    args = ("run", str(publish_definition), "--param", f"day={DAY}", "--idempotency-key", KEY)
    crashed = sqlite_cli(*args, extra_env={"DATAFLOW_CRASH_AT": "after_predispatch_commit"})
    assert crashed.code < 0, crashed.output  # killed by its own SIGKILL at the named point
    database = Database(sqlite_url)
    try:
        database.advance_clock(LEASE_EXPIRY_SHIFT_S)
        decisions = sweeper.sweep(database)
    finally:
        database.dispose()
    assert [d.decision for d in decisions] == ["outcome_unknown"]

    history = sqlite_cli("runs")
    assert history.code == 0 and "UNRESOLVED" in history.stdout and "failed" not in history.stdout
    [listed] = sqlite_cli("runs", "--json").json()
    assert listed["unresolved"] is True and listed["status"] == "outcome_unknown" and listed["warning"]
    run_id = listed["run_id"]

    replay = sqlite_cli(*args)
    assert replay.code == 3, replay.output
    assert "replayed: existing run returned, nothing executed" in replay.stdout and "UNRESOLVED" in replay.stdout
    shown = sqlite_cli("show", run_id)
    assert f"reconcile {run_id}" in shown.stdout and listed["output_digest"] in shown.stdout
    assert listed["publication_idempotency_key"] in shown.stdout
    assert published_rows(publish_definition) == 0

    absent = sqlite_cli("reconcile", run_id, "--json")
    assert absent.code == 0, absent.output
    assert absent.json()["finding"] == "absent" and absent.json()["recovery_status"] == "reconciled_absent"
    resumed = sqlite_cli("reconcile", run_id, "--resume", "--json")
    assert resumed.code == 0, resumed.output
    assert resumed.json()["resumed"] is True and resumed.json()["status"] == "succeeded"
    assert published_rows(publish_definition) == resumed.json()["row_count"]
    assert sqlite_cli("verify", run_id).code == 0
    again = sqlite_cli("reconcile", run_id)
    assert again.code == 5 and again.stderr.startswith("error [conflict]:")
