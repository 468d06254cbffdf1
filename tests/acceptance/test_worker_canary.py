"""Invariant 2 for workers: a canary DSN password and evidence key never reach a worker's logs or output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cli import make_cli
from support.pg import PostgresServer

CANARY_PASSWORD = "canary-worker-pw-61f0"
CANARY_KEY = "canary-worker-evidence-3c9d"


def _definition(folder: Path) -> Path:
    document = {
        "name": "crm_counts",
        "version": 1,
        "sources": {"crm": {"kind": "postgres", "dsn": {"secret": "CANARY_DSN"}, "query": "select 1 as one"}},
        "steps": [{"name": "counted", "sql": "select count(*)::BIGINT as n from crm"}],
        "output": {"schema": {"n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
    }
    path = folder / "crm.json"
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("reachable", [True, False], ids=["source-ok", "source-down"])
def test_worker_logs_hold_no_secret(
    tmp_path: Path, sqlite_url: str, postgres_server: PostgresServer, reachable: bool
) -> None:
    """`dataflow submit` then `dataflow worker --until-idle` (JSON logs on stderr) run a postgres source whose
    DSN carries a canary password, with a canary evidence key; neither appears in any output, and the run
    ends as expected (succeeded when the source is reachable, failed when it is not)."""
    port = postgres_server.port if reachable else 1
    env = {
        "CANARY_DSN": f"postgresql://postgres:{CANARY_PASSWORD}@127.0.0.1:{port}/postgres",
        "DATAFLOW_EVIDENCE_KEY": CANARY_KEY,
    }
    cli = make_cli(sqlite_url, tmp_path)
    submitted = cli("submit", str(_definition(tmp_path)), "--json", extra_env=env)
    assert submitted.code == 0, submitted.output
    worked = cli("worker", "--until-idle", "--poll-interval", "0.05", extra_env=env)
    assert worked.code == 0, worked.output
    shown = cli("show", submitted.json()["run_id"], "--json", extra_env=env)
    assert shown.json()["status"] == ("succeeded" if reachable else "failed")
    everything = submitted.output + worked.output + shown.output
    assert "run.finished" in everything or "run.claimed" in everything, "the worker logged its work"
    assert CANARY_PASSWORD not in everything
    assert CANARY_KEY not in everything
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("dataflow.db*"))
    assert CANARY_PASSWORD.encode() not in stored and CANARY_KEY.encode() not in stored
