"""Acceptance: the Spark example publishes to Delta Lake once from `dataflow run`, and verifies.

`examples/tpch_revenue_spark` (`engine: spark`, TPC-H SF 0.001) runs in forward-recovery mode on a
local Spark session; a replay with the same idempotency key adds nothing to the table, `dataflow
verify` re-derives the run from its ledger, and the published rows are the result's rows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import deltalake
import pytest

from support.cli import EXAMPLES, make_cli
from support.flows import delta_publications

pytestmark = pytest.mark.spark

EXAMPLE = EXAMPLES / "tpch_revenue_spark"
NATIONS = 25  # TPC-H has 25 nations; at SF 0.001 some have no order in a year


def test_the_spark_example_publishes_once_and_verifies(tmp_path: Path, sqlite_url: str) -> None:
    folder = tmp_path / "example"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("warehouse"))
    cli = make_cli(sqlite_url, tmp_path)
    args = ("run", str(folder / "dataflow.yaml"), "--param", "year_start=1994-01-01", "--idempotency-key", "spark-1",
            "--json")
    first = cli(*args)
    assert first.code == 0, first.output
    run = first.json()
    assert run["status"] == "succeeded" and run["mode"] == "forward_recovery", run
    assert run["recovery_status"] == "verified" and 0 < run["row_count"] <= NATIONS
    table = folder / "warehouse" / "revenue_by_nation"
    assert len(delta_publications(table)) == 1
    published = deltalake.DeltaTable(str(table)).to_pyarrow_table()
    assert published.num_rows == run["row_count"]
    assert published.column_names[:3] == ["nation", "revenue", "orders"]

    second = cli(*args)
    assert second.code == 0, second.output
    assert second.json()["run_id"] == run["run_id"] and second.json()["replayed"] is True
    assert len(delta_publications(table)) == 1
    assert deltalake.DeltaTable(str(table)).to_pyarrow_table().num_rows == run["row_count"]

    verified = cli("verify", run["run_id"])
    assert verified.code == 0, verified.output
