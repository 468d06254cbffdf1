"""The output digest ignores chunking, offsets, null-slot bytes and metadata, and sees every value."""

from __future__ import annotations

import datetime as dt
import decimal
import itertools

import pyarrow as pa
import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.core.hashing import is_digest
from durable_dataflow.dataflow import results
from durable_dataflow.dataflow.arrowdigest import output_digest

ROWS = 1_000


def _base() -> pa.Table:
    return pa.table(
        {
            "id": pa.array([None if i % 7 == 0 else i * 1_000_003 for i in range(ROWS)], pa.int64()),
            "name": pa.array([None if i % 11 == 0 else f"customer-{i}-{'x' * (i % 5)}" for i in range(ROWS)]),
            "big": pa.array([f"v{i}" for i in range(ROWS)], pa.large_string()),
            "score": pa.array([i / 3 for i in range(ROWS)], pa.float64()),
            "flag": pa.array([None if i % 13 == 0 else i % 2 == 0 for i in range(ROWS)], pa.bool_()),
            "day": pa.array([dt.date(2026, 11, 1) + dt.timedelta(days=i % 30) for i in range(ROWS)]),
            "at": pa.array([dt.datetime(2026, 11, 2, 8, 0) + dt.timedelta(seconds=i) for i in range(ROWS)],
                           pa.timestamp("us", tz="UTC")),
            "amount": pa.array([None if i % 17 == 0 else decimal.Decimal(i) / 100 for i in range(ROWS)],
                               pa.decimal128(18, 2)),
            "raw": pa.array([bytes([i % 256]) * (i % 3) for i in range(ROWS)], pa.binary()),
        }
    )


def _with_garbage_under_nulls(column: pa.ChunkedArray) -> pa.Array:
    """The same validity and values, but other bytes in the value buffer under every null slot."""
    arr = column.combine_chunks()
    if pa.types.is_integer(arr.type) and arr.null_count:
        filled = arr.fill_null(123_456_789)
        return pa.Array.from_buffers(arr.type, len(arr), [arr.buffers()[0], filled.buffers()[1]],
                                     null_count=arr.null_count)
    if pa.types.is_string(arr.type) and arr.null_count:
        filled = arr.fill_null("GARBAGE")  # null slots now span non-empty byte ranges
        return pa.Array.from_buffers(arr.type, len(arr), [arr.buffers()[0], *filled.buffers()[1:]],
                                     null_count=arr.null_count)
    return arr


def test_digest_is_chunking_offset_garbage_and_metadata_independent() -> None:
    """Proves chunking independence: re-chunked, sliced, garbage-under-nulls and metadata variants hash alike."""
    base = _base()
    cuts = [0, 1, 99, 333, 500, 777, ROWS]
    rechunked = pa.concat_tables([base.slice(a, b - a) for a, b in itertools.pairwise(cuts)])
    bigger = pa.concat_tables([base.slice(ROWS - 123), base, base.slice(0, 45)])
    sliced = bigger.slice(123, ROWS)
    garbage = pa.table({name: _with_garbage_under_nulls(base.column(name)) for name in base.column_names})
    with_metadata = base.replace_schema_metadata({"producer": "someone else"})
    variants = [rechunked, sliced, garbage, with_metadata, base.combine_chunks()]
    assert rechunked.column(0).num_chunks == 6
    assert results.encode_ipc(garbage) != results.encode_ipc(base)  # the bytes really differ
    expected = output_digest(base)
    assert is_digest(expected)
    for variant in variants:
        assert variant.equals(base)
        assert output_digest(variant) == expected


@pytest.mark.parametrize("column", ["id", "name", "big", "score", "flag", "day", "at", "amount", "raw"])
def test_digest_changes_when_one_value_changes(column: str) -> None:
    """Proves sensitivity: replacing the value in row 500 of any column changes the digest."""
    base = _base()
    values = base.column(column).to_pylist()
    replacement = {
        "id": 1, "name": "someone", "big": "other", "score": 0.5, "flag": not values[500],
        "day": dt.date(2030, 1, 1), "at": dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
        "amount": decimal.Decimal("0.01"), "raw": b"changed",
    }[column]
    values[500] = replacement
    index = base.column_names.index(column)
    changed = base.set_column(index, base.schema.field(index), pa.array(values, base.schema.field(index).type))
    assert output_digest(changed) != output_digest(base)


def test_digest_distinguishes_null_from_zero_and_string_boundaries() -> None:
    """Proves the framing: [null] differs from [0], ['ab','c'] from ['a','bc'], and the type is hashed."""
    assert output_digest(pa.table({"x": pa.array([None], pa.int64())})) != output_digest(
        pa.table({"x": pa.array([0], pa.int64())})
    )
    assert output_digest(pa.table({"a": ["ab", "c"]})) != output_digest(pa.table({"a": ["a", "bc"]}))
    assert output_digest(pa.table({"a": pa.array([1], pa.int32())})) != output_digest(
        pa.table({"a": pa.array([1], pa.int64())})
    )
    assert output_digest(pa.table({"a": [1]})) != output_digest(pa.table({"b": [1]}))


def test_digest_of_empty_table_and_dictionary_column() -> None:
    """Proves an empty result hashes, and a dictionary column hashes its decoded values deterministically."""
    empty = pa.table({"x": pa.array([], pa.int64()), "s": pa.array([], pa.string())})
    assert is_digest(output_digest(empty))
    assert output_digest(empty) != output_digest(pa.table({"x": pa.array([0], pa.int64()), "s": [""]}))
    encoded = pa.table({"s": pa.array(["a", "b", "a"]).dictionary_encode()})
    rechunked = pa.concat_tables([encoded.slice(0, 1), encoded.slice(1)])
    assert output_digest(encoded) == output_digest(rechunked)


def test_digest_refuses_nested_types() -> None:
    """Proves nested columns are refused with an InputError naming the column, not hashed ambiguously."""
    nested = pa.table({"tags": pa.array([["a"], ["b", "c"]])})
    with pytest.raises(InputError, match="'tags'"):
        output_digest(nested)


def test_ipc_round_trip_and_exports() -> None:
    """Proves encode/decode round-trips and that the JSON export writes decimals as strings and dates as ISO."""
    table = pa.table({"day": [dt.date(2026, 11, 2)], "revenue": pa.array([decimal.Decimal("12.50")],
                                                                       pa.decimal128(18, 2))})
    assert results.decode_ipc(results.encode_ipc(table)).equals(table)
    assert results.export(table, "json") == b'[{"day":"2026-11-02","revenue":"12.50"}]'
    assert results.export(table, "csv").splitlines()[0] == b'"day","revenue"'
    assert results.export(table, "parquet").startswith(b"PAR1")
    with pytest.raises(InputError):
        results.decode_ipc(b"not arrow")
