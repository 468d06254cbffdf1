"""dataflow.results.export: values a format cannot write are refused with the format that can."""

from __future__ import annotations

import pyarrow as pa
import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.execution import results


def test_bytes_that_are_not_utf8_are_refused_by_csv_and_written_by_json_and_parquet() -> None:
    """Proves a binary column holding b"\\xff" is an InputError naming the formats that work (Arrow's
    CSV writer raised ArrowInvalid, an internal error), and that JSON writes it as hex."""
    table = pa.table({"b": pa.array([b"\xff", None], pa.binary())})
    with pytest.raises(InputError, match=r"cannot be written as CSV .*: export it as parquet or json"):
        results.export(table, "csv")
    assert results.export(table, "json") == b'[{"b":"ff"},{"b":null}]'
    assert results.export(table, "parquet").startswith(b"PAR1")


@pytest.mark.parametrize(
    "column",
    [
        pa.array([2**62], pa.timestamp("us")),  # year 146,138
        pa.array([2**31 - 1], pa.date32()),  # year 5,881,580
    ],
)
def test_times_past_year_9999_are_refused_by_json_and_written_by_csv(column: pa.Array) -> None:
    """Proves a date or timestamp Python cannot hold is an InputError from the JSON export (to_pylist
    raised OverflowError or ValueError), while CSV and Parquet still write the table."""
    table = pa.table({"t": column})
    with pytest.raises(InputError, match="outside years 1 to 9999, which JSON export cannot write"):
        results.export(table, "json")
    assert results.export(table, "csv").startswith(b'"t"\n')
    assert results.export(table, "parquet").startswith(b"PAR1")
