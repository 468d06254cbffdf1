"""Issue 31's "done when", through the CLI as a user runs it, on both platform databases: a definition
reading TPC-H orders (made by tpchgen-cli) as Parquet from s3:// and publishing to a Delta table on
s3:// runs; replays without a second commit; survives a dropped PUT answer (a proxy between the
platform and the store forwards the commit's PUT and drops every answer from then on) through
`dataflow reconcile`; and the table, read back without delta-rs (its log replayed with boto3, its
files read with pyarrow), holds each key's publication once with the rows DuckDB computes from the
same file on local disk."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pytest

from support.cli import make_cli
from support.s3 import ACCESS_KEY, SECRET_KEY, FaultProxy, S3Place, delta_log_rows, delta_publication_commits

TABLE = "warehouse/order_totals"
LATER_COMMIT = r"/_delta_log/(?!0{20})\d{20}\.json$"
SQL = (
    "select o_orderstatus as status, count(*)::BIGINT as orders, sum(o_totalprice)::DECIMAL(18,2) as total "
    "from orders group by o_orderstatus order by o_orderstatus"
)


@pytest.fixture(scope="module")
def orders_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TPC-H orders at scale factor 0.01 (15,000 rows), one Parquet file, from tpchgen-cli."""
    tool = shutil.which("tpchgen-cli") or str(Path(sys.executable).with_name("tpchgen-cli"))
    folder = tmp_path_factory.mktemp("tpch")
    subprocess.run(
        [tool, "parquet", "-s", "0.01", "--tables", "orders", "--output-dir", str(folder)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return folder / "orders.parquet"


def definition(s3: S3Place, endpoint: str) -> dict[str, Any]:
    return {
        "name": "order_totals", "version": 1,
        "sources": {"orders": {"kind": "parquet", "path": s3.url("tpch/orders/"), "options": s3.options()}},
        "steps": [{"name": "totals", "sql": SQL}],
        "output": {"schema": {"status": "string", "orders": "int64", "total": "decimal(18,2)"},
                   "max_rows": 10, "max_bytes": "1MiB"},
        "target": {"type": "datasources.publication", "provider": "delta", "datasource": "warehouse.order_totals",
                   "location": s3.url(TABLE), "mode": "append", "options": s3.options(endpoint)},
    }  # fmt: skip


def test_parquet_from_s3_to_delta_on_s3_runs_replays_and_survives_a_lost_answer(
    db_url: str, s3: S3Place, orders_file: Path, tmp_path: Path
) -> None:
    s3.client().upload_file(str(orders_file), s3.bucket, "tpch/orders/orders.parquet")
    expected = duckdb.sql(SQL.replace("from orders", f"from read_parquet('{orders_file}')")).fetchall()
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        path = tmp_path / "order_totals.yaml"
        path.write_text(json.dumps(definition(s3, proxy.endpoint)))
        cli = make_cli(db_url, tmp_path)

        first = cli("run", str(path), "--idempotency-key", "2026-12-01", "--json")
        assert first.code == 0, first.output
        run = first.json()
        assert (run["status"], run["recovery_status"]) == ("succeeded", "verified"), run
        replay = cli("run", str(path), "--idempotency-key", "2026-12-01", "--json")
        assert replay.code == 0 and replay.json()["run_id"] == run["run_id"], replay.output

        proxy.lose_answer("PUT", LATER_COMMIT, then_blackhole=True)
        lost = cli("run", str(path), "--idempotency-key", "2026-12-02", "--json")
        assert proxy.fired == 1
        unknown = lost.json()
        assert unknown["status"] == "outcome_unknown", lost.output
        proxy.heal()
        settled = cli("reconcile", unknown["run_id"], "--json")
        assert settled.code == 0, settled.output
        said = settled.json()
        assert (said["finding"], said["status"], said["recovery_status"]) == (
            "present", "succeeded", "reconciled_present",
        )  # fmt: skip
        verified = cli("verify", unknown["run_id"])
        assert verified.code == 0, verified.output
    finally:
        proxy.stop()
    outputs = first.output + replay.output + lost.output + settled.output
    assert ACCESS_KEY not in outputs and SECRET_KEY not in outputs

    client = s3.client()
    for key in (run["publication_idempotency_key"], unknown["publication_idempotency_key"]):
        assert delta_publication_commits(client, s3.bucket, TABLE, key) == 1, key
    table = delta_log_rows(client, s3.bucket, TABLE)
    read = sorted((r["status"], r["orders"], r["total"]) for r in table.to_pylist())
    assert read == sorted(expected * 2)
    assert sum(orders for _, orders, _ in expected) == 15_000
