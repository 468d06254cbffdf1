"""How long `dataflow validate` takes to find the wrong output type of issue 30 (`segment: int64` declared
for a text column) on a 6 M-row Parquet source, in process: the first validation (imports and the first
sandbox database included) and the median of ``ROUNDS`` more. Only the footer is read, so the time does
not grow with the rows: ``ROWS_SMALL`` rows are timed beside it for comparison.

    .venv/bin/python benchmarks/bench_validate.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROWS = 6_000_000
ROWS_SMALL = 1_000
ROUNDS = 7
DEFINITION = """\
name: segments
version: 1
sources:
  orders: {kind: parquet, path: orders.parquet}
steps:
  - name: by_segment
    sql: select segment, count(*) as n, sum(amount) as total from orders group by segment
output:
  schema: {segment: int64, n: int64, total: float64}
  max_rows: 100
  max_bytes: 1MiB
"""


def _folder(root: Path, rows: int) -> Path:
    folder = root / str(rows)
    folder.mkdir()
    ids = np.arange(rows)
    table = pa.table({"id": ids, "segment": np.where(ids % 3 == 0, "retail", "wholesale"), "amount": ids * 0.5})
    pq.write_table(table, folder / "orders.parquet", row_group_size=1_000_000)
    (folder / "segments.yaml").write_text(DEFINITION)
    return folder


def _timings(folder: Path) -> tuple[float, float]:
    from durable_dataflow.dataflow.definitions.definitions import load_definition
    from durable_dataflow.dataflow.execution import workspace
    from durable_dataflow.dataflow.protocol.requests import AccessContext
    from durable_dataflow.dataflow.protocol.validation import validate_definition
    from durable_dataflow.platform import Platform

    with Platform(f"sqlite:///{folder / 'platform.db'}") as platform:
        loaded = load_definition(folder / "segments.yaml")
        space, access = workspace.local(loaded.base_dir), AccessContext.local("default")
        times = []
        for _ in range(ROUNDS + 1):
            started = time.perf_counter()
            report = validate_definition(platform.runs, loaded.definition, {}, space, access)
            times.append(time.perf_counter() - started)
            assert [(p.step, p.column) for p in report.problems] == [("by_segment", "segment")], report.problems
    return times[0], statistics.median(times[1:])


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        for rows in (ROWS, ROWS_SMALL):
            folder = _folder(Path(root), rows)
            first, median = _timings(folder)
            size_mib = (folder / "orders.parquet").stat().st_size / 2**20
            print(f"{rows:>9} rows ({size_mib:6.1f} MiB): first validation {first * 1000:7.1f} ms, "
                  f"then median {median * 1000:6.1f} ms")


if __name__ == "__main__":
    main()
