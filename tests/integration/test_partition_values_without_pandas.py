"""A partition publication never makes pyarrow import pandas (found by benchmarks/bench_partitions.py).

The row check before the pre-dispatch commit and the provider's partition values converted the run's
partition value with `pa.scalar(value)`, and `pc.fill_null(..., False)` a Python False: pyarrow looks for
pandas on every conversion of a Python value, so each `dataflow run` publishing a partition imported it
(≈ 0.4 s of CPU and 40 MiB of peak memory, a third of the run beside an append of the same day).
`contract.typed_scalar` builds the value from Arrow buffers and casts it as before: the same values fit,
the same ones are refused.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.datasources.contract import typed_scalar

TYPES = [
    pa.string(), pa.large_string(), pa.int8(), pa.int32(), pa.int64(), pa.uint64(), pa.bool_(), pa.date32(),
    pa.timestamp("us"), pa.timestamp("us", tz="UTC"), pa.decimal128(12, 2),
]  # fmt: skip
VALUES: list[Any] = [
    "2024-03-01", "x' OR '1'='1", "", "é", "3", "-3", "300", "true", "True", "1.50", "2024-03-01T10:00:00",
    "2024-03-01 10:00:00+00:00", "\ud800", 3, -3, 0, 300, 2**40, 2**63 - 1, -(2**63), 2**63, True, False,
    dt.date(2024, 3, 1), Decimal("1.50"),
]  # fmt: skip


def _outcome(convert: Any) -> tuple[str, Any]:
    try:
        return "fits", convert().as_py()
    except Exception as error:
        return "refused", type(error).__name__


@pytest.mark.parametrize("arrow_type", TYPES, ids=str)
def test_typed_scalar_is_pa_scalar_cast(arrow_type: pa.DataType) -> None:
    """The same value, or the same refusal, as `pa.scalar(value).cast(type)` for every value and type."""
    for value in VALUES:
        expected = _outcome(lambda v=value: pa.scalar(v).cast(arrow_type))
        assert _outcome(lambda v=value: typed_scalar(v, arrow_type)) == expected, (value, arrow_type)


CHILD = """
import json, sys
from pathlib import Path
from durable_dataflow.dataflow.definitions.definitions import parse_definition
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.platform import Platform

spec = json.loads(sys.argv[1])
statuses = []
with Platform(spec["db_url"]) as platform:
    definition = parse_definition(json.dumps(spec["definition"]), "<test>")
    for key, day in (("a", "2024-03-01"), ("b", "2024-03-01"), ("c", "2024-03-02")):
        request = RunRequest(
            definition=definition, base_dir=Path(spec["base_dir"]), parameters={"day": day, "flag": True},
            access=AccessContext.local(), provenance=Provenance(actor="test", trigger="cli"), idempotency_key=key,
        )
        run = platform.runs.run_inline(request).run
        statuses.append([str(run.status), run.error_code])
print(json.dumps({"statuses": statuses, "pandas": "pandas" in sys.modules}))
"""


def test_a_partition_publication_does_not_import_pandas(tmp_path: Path) -> None:
    """A fresh interpreter publishes a new day, replaces it and publishes another (Delta, replace_partition,
    partitioned by a date and a boolean, from a Parquet source): everything succeeds and pandas was never
    imported."""
    definition = {
        "name": "no_pandas",
        "version": 1,
        "parameters": {"day": {"type": "date"}, "flag": {"type": "bool"}},
        "sources": {"items": {"kind": "parquet", "path": "items.parquet"}},  # an inline source's rows import it
        "steps": [{"name": "rows", "sql": "select $day::DATE as day, $flag as flag, n from items"}],
        "output": {"schema": {"day": "date", "flag": "bool", "n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
        "target": {
            "type": "datasources.publication", "provider": "delta", "datasource": "test.no_pandas",
            "location": "daily", "mode": "replace_partition", "partition": {"day": "$day", "flag": "$flag"},
        },
    }  # fmt: skip
    pq.write_table(pa.table({"n": pa.array([1, 2], pa.int64())}), tmp_path / "items.parquet")
    spec = {"db_url": f"sqlite:///{tmp_path}/dataflow.db", "base_dir": str(tmp_path), "definition": definition}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["statuses"] == [["succeeded", None]] * 3
    assert found["pandas"] is False, "a partition publication imported pandas"
