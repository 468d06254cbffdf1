"""Acceptance: each publishing example publishes from `dataflow run` to its provider exactly once.

The Parquet folder, the Delta table and the PostgreSQL table are read directly after a run and a
replay with the same idempotency key: the second run adds nothing to the sink.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from support.cli import PUBLISH_EXAMPLE, make_cli
from support.flows import delta_publications


def _copy_example(tmp_path: Path) -> Path:
    folder = tmp_path / "example"
    shutil.copytree(PUBLISH_EXAMPLE, folder, ignore=shutil.ignore_patterns("warehouse"))
    return folder


def _publications_in_parquet(folder: Path) -> int:
    manifests = [json.loads(p.read_text()) for p in folder.glob("_manifests/*.json")]
    return sum(1 for m in manifests if m["kind"] == "publication")


def _publications_in_postgres(url: str) -> tuple[int, int]:
    with psycopg.connect(sa.engine.make_url(url).set(drivername="postgresql").render_as_string(False)) as conn:
        pubs = conn.execute("SELECT count(*) FROM sink_publications").fetchone()
        rows = conn.execute("SELECT count(*) FROM daily_revenue").fetchone()
    assert pubs is not None and rows is not None
    return int(pubs[0]), int(rows[0])


@pytest.mark.parametrize("definition", ["dataflow.yaml", "delta.yaml", "postgres.yaml"])
def test_example_publishes_once_from_the_cli(
    definition: str, tmp_path: Path, sqlite_url: str, request: pytest.FixtureRequest
) -> None:
    """`dataflow run` publishes the example; a second run with the same key replays and the sink is unchanged."""
    folder = _copy_example(tmp_path)
    cli = make_cli(sqlite_url, tmp_path)
    extra_env: dict[str, str] = {}
    if definition == "postgres.yaml":
        extra_env["SINK_DSN"] = request.getfixturevalue("pg_url")
    args = ("run", str(folder / definition), "--param", "day=2026-11-02", "--idempotency-key", "pub-1", "--json")
    first = cli(*args, extra_env=extra_env)
    assert first.code == 0, first.output
    run = first.json()
    assert run["status"] == "succeeded" and run["mode"] == "forward_recovery"
    assert run["publication_ref"] and run["materialization_ref"] and run["publication_idempotency_key"]
    second = cli(*args, extra_env=extra_env)
    assert second.code == 0, second.output
    assert second.json()["run_id"] == run["run_id"] and second.json()["replayed"] is True
    if definition == "dataflow.yaml":
        assert _publications_in_parquet(folder / "warehouse" / "daily_revenue") == 1
    elif definition == "delta.yaml":
        assert len(delta_publications(folder / "warehouse" / "daily_revenue_delta")) == 1
    else:
        assert _publications_in_postgres(extra_env["SINK_DSN"]) == (1, run["row_count"])
