"""Acceptance: `dataflow validate FILE` (issue 30, item 2) checks a definition without reading its data and
without recording anything; exit 0 when valid, 2 (the CLI's invalid-input status) when not.

The wrong output type of the issue (`segment: int64` declared for a text column) is found over a Parquet
file of 300,000 rows whose data pages are overwritten with garbage, footer intact: reading any data page
would fail, so finding the mistake proves only the footer was read. A run of the same definition reads
the pages and fails, which proves the garbage is there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.platform import Platform
from support import flows
from support.cli import make_cli

ROWS = 300_000
DEFINITION = """\
name: segments
version: 1
sources:
  orders: {kind: parquet, path: orders.parquet}
steps:
  - name: by_segment
    sql: select segment, count(*) as n, sum(amount) as total from orders group by segment order by segment
output:
  schema: {segment: SEGMENT_TYPE, n: int64, total: float64}
  max_rows: 100
  max_bytes: 1MiB
"""


def _orders_with_garbage_pages(folder: Path) -> Path:
    """A Parquet file of ROWS rows whose bytes between the leading magic and the footer are garbage."""
    ids = np.arange(ROWS)
    table = pa.table({
        "id": ids, "segment": np.where(ids % 3 == 0, "retail", "wholesale"), "amount": ids * 0.5,
    })  # fmt: skip
    path = folder / "orders.parquet"
    pq.write_table(table, path, row_group_size=100_000)
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.seek(size - 8)
        footer_bytes = int.from_bytes(handle.read(4), "little")
        data_end = size - 8 - footer_bytes
        handle.seek(4)
        handle.write(b"\xff" * (data_end - 4))
    with pytest.raises(OSError):  # the pages really are unreadable
        pq.read_table(path)
    return path


def test_validate_finds_the_wrong_output_type_from_the_footer_alone(sqlite_url: str, tmp_path: Path) -> None:
    """`segment: int64` exits 2 naming the step and the column; `segment: string` exits 0 with the result's
    columns (--json); a run of it fails on the garbage pages; validation recorded no run,
    no ledger entry and no definition (only the run did)."""
    _orders_with_garbage_pages(tmp_path)
    (tmp_path / "wrong.yaml").write_text(DEFINITION.replace("SEGMENT_TYPE", "int64"))
    (tmp_path / "right.yaml").write_text(DEFINITION.replace("SEGMENT_TYPE", "string"))
    cli = make_cli(sqlite_url, tmp_path)

    wrong = cli("validate", "wrong.yaml")
    assert wrong.code == 2, wrong.output
    assert "invalid: segments version 1" in wrong.stdout
    assert "column 'segment' of step 'by_segment'" in wrong.stdout and "declares int64" in wrong.stdout
    assert "Traceback" not in wrong.output

    right = cli("validate", "right.yaml", "--json")
    assert right.code == 0, right.output
    assert right.json()["result_columns"] == [
        {"name": "segment", "type": "string"}, {"name": "n", "type": "int64"}, {"name": "total", "type": "double"},
    ]
    with Platform(sqlite_url) as platform:
        assert flows.row_counts(platform) == {name: 0 for name in flows.row_counts(platform)}

    run = cli("run", "right.yaml")
    assert run.code == 1, run.output  # the run reads the pages: they are garbage


def test_validate_refuses_a_step_that_reads_a_file_and_bad_parameters(sqlite_url: str, tmp_path: Path) -> None:
    """A step reading /etc/passwd by path exits 2 naming the step (the sandbox's refusal, as a run's); a
    --param value that does not fit its type exits 2 naming the parameter, never echoing the value; neither
    records anything."""
    pq.write_table(pa.table({"segment": ["retail"], "amount": [1.0]}), tmp_path / "orders.parquet")
    hostile = DEFINITION.replace("SEGMENT_TYPE", "string").replace(
        "from orders group by segment order by segment", "from read_parquet('/etc/passwd') group by segment"
    )
    (tmp_path / "hostile.yaml").write_text(hostile)
    cli = make_cli(sqlite_url, tmp_path)
    refused = cli("validate", "hostile.yaml")
    assert refused.code == 2, refused.output
    assert "step 'by_segment'" in refused.stdout and "table function read_parquet" in refused.stdout

    declared = "parameters:\n  day: {type: date}\nsources:"
    dated = DEFINITION.replace("SEGMENT_TYPE", "string").replace("sources:", declared)
    (tmp_path / "dated.yaml").write_text(dated)
    bad = cli("validate", "dated.yaml", "--param", "day=someday")
    assert bad.code == 2, bad.output
    assert "parameter 'day'" in bad.stdout and "someday" not in bad.stdout
    with Platform(sqlite_url) as platform:
        assert flows.row_counts(platform) == {name: 0 for name in flows.row_counts(platform)}
