"""The output digest ignores chunking, batching, offsets, null-slot bytes and metadata, and sees every value."""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import itertools
import os
import struct
import threading
from collections.abc import Callable
from unittest.mock import patch

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import EvidenceError, InputError
from durable_dataflow.core.hashing import is_digest
from durable_dataflow.core.invariants import InvariantViolation
from durable_dataflow.dataflow.execution import arrowdigest, results
from durable_dataflow.dataflow.execution.arrowdigest import (
    DIGEST_FORMAT_VERSION,
    DIGEST_THREADS_MAX,
    OutputDigester,
    output_digest,
    output_digest_v2,
)
from durable_dataflow.dataflow.protocol import evidence
from durable_dataflow.dataflow.schema import run_results
from support.arrow_tables import BASE_DIGEST_V2, BASE_DIGEST_V3, ROWS, base_table

DIGESTS = [pytest.param(output_digest, id="v3"), pytest.param(output_digest_v2, id="v2")]


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


def _digest_in_batches(table: pa.Table, cuts: list[int]) -> str:
    """The streaming digest of table fed as the batches between consecutive cuts (sorted, 0 to num_rows)."""
    digester = OutputDigester(table.schema)
    for start, end in itertools.pairwise(cuts):
        for batch in table.slice(start, end - start).to_batches() or [pa.RecordBatch.from_pylist([], table.schema)]:
            digester.update(batch)
    assert digester.rows == table.num_rows
    return digester.digest()


def _packed(bits: list[bool]) -> bytes:
    """Bits as one LSB-first bitmap, the unused bits of the last byte zero."""
    return sum(1 << i for i, bit in enumerate(bits) if bit).to_bytes((len(bits) + 7) // 8, "little")


def _v3_by_the_docstring(table: pa.Table) -> str:
    """Format v3 computed row by row from whole columns, as the module docstring states it: no
    streaming, no Arrow kernels, null slots written as zero bytes by hand."""
    header = {"v": 3, "schema": [[f.name, str(f.type), f.nullable] for f in table.schema],
              "rows": str(table.num_rows)}
    h = hashlib.sha256(hashing.canonical_json(header))
    for column in table.columns:
        arr = column.combine_chunks()
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        valid = arr.is_valid().to_pylist()
        h.update(b"\x00col")
        h.update(b"V" + hashlib.sha256(_packed(valid)).digest() if not all(valid) else b"N")
        if pa.types.is_boolean(arr.type):
            h.update(hashlib.sha256(_packed([bool(v) for v in arr.to_pylist()])).digest())
        elif arr.type in (pa.string(), pa.binary(), pa.large_string(), pa.large_binary()):
            values = [v or b"" for v in pc.cast(arr, pa.large_binary()).to_pylist()]
            width = "q" if arr.type in (pa.large_string(), pa.large_binary()) else "i"
            h.update(hashlib.sha256(struct.pack(f"<{len(values)}{width}", *map(len, values))).digest())
            h.update(hashlib.sha256(b"".join(values)).digest())
        else:
            w = arr.type.byte_width
            buffer = memoryview(arr.buffers()[1]) if len(arr) else memoryview(b"")
            rows = (buffer[(arr.offset + i) * w : (arr.offset + i + 1) * w] if ok else bytes(w)
                    for i, ok in enumerate(valid))  # fmt: skip
            h.update(hashlib.sha256(b"".join(rows)).digest())
    return hashing.PREFIX + h.hexdigest()


def test_v3_is_what_the_docstring_says_and_v2_is_unchanged() -> None:
    """Proves the formats: v3 equals an independent whole-column reading of the docstring, and both
    v3 and v2 of the base table equal their pinned digests (v2 as computed before v3 existed)."""
    base = base_table()
    assert DIGEST_FORMAT_VERSION == 3
    assert output_digest(base) == _v3_by_the_docstring(base) == BASE_DIGEST_V3
    assert output_digest_v2(base) == BASE_DIGEST_V2
    assert output_digest(base) != output_digest_v2(base)
    empty = pa.table({"x": pa.array([], pa.int64())})
    assert output_digest(empty) == _v3_by_the_docstring(empty) != output_digest_v2(empty)


@pytest.mark.parametrize("digest", DIGESTS)
def test_digest_is_chunking_offset_garbage_and_metadata_independent(digest: Callable[[pa.Table], str]) -> None:
    """Proves chunking independence (v3 and v2): re-chunked, sliced, garbage-under-nulls and metadata
    variants hash alike."""
    base = base_table()
    cuts = [0, 1, 99, 333, 500, 777, ROWS]
    rechunked = pa.concat_tables([base.slice(a, b - a) for a, b in itertools.pairwise(cuts)])
    bigger = pa.concat_tables([base.slice(ROWS - 123), base, base.slice(0, 45)])
    sliced = bigger.slice(123, ROWS)
    garbage = pa.table({name: _with_garbage_under_nulls(base.column(name)) for name in base.column_names})
    with_metadata = base.replace_schema_metadata({"producer": "someone else"})
    variants = [rechunked, sliced, garbage, with_metadata, base.combine_chunks()]
    assert rechunked.column(0).num_chunks == 6
    assert results.encode_ipc(garbage) != results.encode_ipc(base)  # the bytes really differ
    expected = digest(base)
    assert is_digest(expected)
    for variant in variants:
        assert variant.equals(base)
        assert digest(variant) == expected


@pytest.mark.parametrize("column", ["id", "name", "big", "score", "flag", "day", "at", "amount", "raw"])
def test_digest_changes_when_one_value_changes(column: str) -> None:
    """Proves sensitivity: replacing the value in row 500 of any column changes the digest."""
    base = base_table()
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
    """Proves the framing: [null] differs from [0] (also as a bool, string and a second batch), ['ab','c']
    from ['a','bc'], [True] from [False], and the name, type and nullability are hashed."""
    assert output_digest(pa.table({"x": pa.array([None], pa.int64())})) != output_digest(
        pa.table({"x": pa.array([0], pa.int64())})
    )
    assert output_digest(pa.table({"x": pa.array([None], pa.bool_())})) != output_digest(
        pa.table({"x": pa.array([False], pa.bool_())})
    )
    assert output_digest(pa.table({"s": pa.array([None], pa.string())})) != output_digest(pa.table({"s": [""]}))
    one, null = pa.table({"x": pa.array([1], pa.int64())}), pa.table({"x": pa.array([None], pa.int64())})
    two_batches = pa.concat_tables([one, null])
    assert output_digest(two_batches) != output_digest(pa.table({"x": pa.array([1, 0], pa.int64())}))
    assert output_digest(pa.table({"a": ["ab", "c"]})) != output_digest(pa.table({"a": ["a", "bc"]}))
    assert output_digest(pa.table({"a": [True]})) != output_digest(pa.table({"a": [False]}))
    assert output_digest(pa.table({"a": pa.array([1], pa.int32())})) != output_digest(
        pa.table({"a": pa.array([1], pa.int64())})
    )
    assert output_digest(pa.table({"a": [1]})) != output_digest(pa.table({"b": [1]}))
    nullable = pa.table({"a": [1]})
    required = nullable.cast(pa.schema([pa.field("a", pa.int64(), nullable=False)]))
    assert output_digest(nullable) != output_digest(required)


def test_digest_of_empty_table_and_dictionary_column() -> None:
    """Proves an empty result hashes, and a dictionary column (with a null, in two batches with their own
    dictionaries) hashes its decoded values as the docstring says, with the dictionary type in the header."""
    empty = pa.table({"x": pa.array([], pa.int64()), "s": pa.array([], pa.string())})
    assert is_digest(output_digest(empty))
    assert output_digest(empty) != output_digest(pa.table({"x": pa.array([0], pa.int64()), "s": [""]}))
    encoded = pa.table({"s": pa.array(["a", "b", None, "a"]).dictionary_encode()})
    rechunked = pa.concat_tables([encoded.slice(0, 1), pa.table({"s": pa.array(["b", None, "a"]).dictionary_encode()})])
    assert output_digest(encoded) == output_digest(rechunked) == _v3_by_the_docstring(encoded)
    assert output_digest(encoded) != output_digest(pa.table({"s": ["a", "b", None, "a"]}))


def test_digest_refuses_nested_types() -> None:
    """Proves nested columns are refused with an InputError naming the column, by the digester's
    constructor (before any batch) and by both formats, not hashed ambiguously."""
    nested = pa.table({"tags": pa.array([["a"], ["b", "c"]])})
    with pytest.raises(InputError, match="'tags'"):
        OutputDigester(pa.schema([("id", pa.int64()), ("tags", pa.list_(pa.string()))]))
    with pytest.raises(InputError, match="'point'"):
        OutputDigester(pa.schema([("point", pa.struct([("x", pa.int64())]))]))
    with pytest.raises(InputError, match="'tags'"):
        output_digest(nested)
    with pytest.raises(InputError, match="'tags'"):
        output_digest_v2(nested)


def test_digester_refuses_another_schema_and_use_after_digest() -> None:
    """Proves the digester's contract: a batch of another schema is an InputError, zero-row batches
    count nothing, and update or digest after digest() is an InvariantViolation (a caller bug)."""
    table = pa.table({"x": pa.array([1, 2], pa.int64())})
    digester = OutputDigester(table.schema)
    with pytest.raises(InputError, match="schema"):
        digester.update(pa.RecordBatch.from_pydict({"x": pa.array([1], pa.int32())}))
    digester.update(pa.RecordBatch.from_pylist([], table.schema))
    assert digester.rows == 0
    digester.update(table.replace_schema_metadata({"k": "v"}).to_batches()[0])  # metadata is not the schema
    assert digester.rows == 2
    assert digester.digest() == output_digest(table)
    with pytest.raises(InvariantViolation):
        digester.update(table.to_batches()[0])
    with pytest.raises(InvariantViolation):
        digester.digest()


@st.composite
def _tables_and_cuts(draw: st.DrawFn) -> tuple[pa.Table, int, list[int], int]:
    """A random table of every supported kind, padding rows to slice it from, batch cut points, and
    the rows after which the digester hashes the batches it holds (so groups split the table too)."""
    rows = draw(st.integers(0, 150))
    pad = draw(st.integers(0, 13))  # rows before and after: the digested batches are slices with offsets
    rng = draw(st.randoms(use_true_random=True))  # seeded by hypothesis; drawing each value is far slower
    total = rows + 2 * pad

    def column(value: Callable[[], object]) -> list[object]:
        # Per column, some tables have no null at all and others many: batches with and without nulls mix.
        null_rate = rng.choice([0.0, 0.0, 0.05, 0.3, 0.9])
        return [None if rng.random() < null_rate else value() for _ in range(total)]

    def text() -> str:
        return "".join(rng.choices("abé\x00", k=rng.randrange(6)))

    table = pa.table({
        "i": pa.array(column(lambda: rng.choice([0, -1, 2**63 - 1, -(2**63), rng.getrandbits(63)])), pa.int64()),
        "f": pa.array(column(lambda: rng.choice([0.0, -0.0, float("inf"), rng.uniform(-1e9, 1e9)])), pa.float64()),
        "s": pa.array(column(text), pa.string()),
        "b": pa.array(column(lambda: rng.random() < 0.5), pa.bool_()),
        "d": pa.array(column(lambda: dt.date(1970, 1, 1) + dt.timedelta(days=rng.randrange(-10**5, 10**5))),
                      pa.date32()),
        "t": pa.array(column(lambda: rng.getrandbits(60)), pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "m": pa.array(column(lambda: decimal.Decimal(rng.randrange(-(10**10), 10**10)) / 100), pa.decimal128(18, 2)),
        "l": pa.array(column(text), pa.large_string()),
    })  # fmt: skip
    cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=12)))  # repeats give zero-row batches
    return table, pad, [0, *cuts, rows], draw(st.integers(1, 64))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_tables_and_cuts())
def test_digest_is_the_same_for_every_batch_split(drawn: tuple[pa.Table, int, list[int], int]) -> None:
    """Proves batching independence by property: random tables (every supported kind, with and without
    nulls) fed as random batches (zero-row, offset slices, cuts off byte boundaries) and hashed in random
    groups digest as one batch, and as the whole-column reading of the docstring."""
    padded, pad, cuts, group_rows = drawn
    table = padded.slice(pad, cuts[-1])
    expected = _digest_in_batches(table.combine_chunks(), [0, len(table)])
    with patch.object(arrowdigest, "_GROUP_ROWS", group_rows):
        assert _digest_in_batches(table, cuts) == expected
    assert expected == _v3_by_the_docstring(table)


def test_groups_and_threads_digest_like_one_batch_on_one_thread() -> None:
    """Proves grouping and the thread pool change nothing: a 300,000-row table as one batch (hashed in
    slices) and as 197-row batches read from an IPC stream (held, then hashed in groups), each with the
    default threads and with one, digest alike; digest() leaves no digester thread running."""
    n = 300_000
    ints = pa.array(range(n), pa.int64())
    table = pa.table({
        "id": ints,
        "n": pc.if_else(pc.equal(pc.bit_wise_and(ints, 7), 3), pa.scalar(None, pa.int64()), ints),
        "s": pc.binary_join_element_wise("row-", pc.cast(ints, pa.string()), ""),
        "b": pc.equal(pc.bit_wise_and(ints, 1), 0),
    })  # fmt: skip
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=197):
            writer.write_batch(batch)
    with ipc.open_stream(sink.getvalue()) as reader:
        streamed = list(reader)  # each batch has buffers of its own, as a stream delivers them
    assert n > arrowdigest._GROUP_ROWS > arrowdigest._PARALLEL_ROWS_MIN > 197
    digests = set()
    one_batch = table.combine_chunks().to_batches()
    for batches, threads_max in itertools.product([streamed, one_batch], [DIGEST_THREADS_MAX, 1]):
        digester = OutputDigester(table.schema, threads_max=threads_max)
        for batch in batches:
            digester.update(batch)
        assert 0 < digester._group_rows < n  # a group was hashed already, the last one is still held
        assert (digester._pool is not None) == (threads_max > 1 and (os.cpu_count() or 1) > 1)
        digests.add(digester.digest())
    assert len(digests) == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("output-digest")]


def test_digest_survives_ipc_round_trips() -> None:
    """Proves stored bytes verify: the base table written as IPC (one batch, or many uneven batches as a
    streaming writer would) and read back digests as before, in both formats."""
    base = base_table()
    assert output_digest(results.decode_ipc(results.encode_ipc(base))) == BASE_DIGEST_V3
    assert output_digest_v2(results.decode_ipc(results.encode_ipc(base))) == BASE_DIGEST_V2
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, base.schema) as writer:
        for start, end in itertools.pairwise([0, 3, 3, 250, 251, 999, ROWS]):
            writer.write_table(base.slice(start, end - start))
    streamed = results.decode_ipc(sink.getvalue().to_pybytes())
    assert streamed.column(0).num_chunks > 1
    assert output_digest(streamed) == BASE_DIGEST_V3


def test_stored_result_digest_verifies_each_format_under_its_own_digest() -> None:
    """Proves stored_result_digest on real SQLite: a legacy row is verified with v2, a v3 row with v3,
    an unknown format is an EvidenceError, and both format names fit the format column."""
    base = base_table()
    engine = sa.create_engine("sqlite://")
    run_results.create(engine)
    stored = {"legacy": results.FORMAT_IPC_DIGEST_V2, "new": results.FORMAT_IPC_DIGEST_V3, "odd": "parquet"}
    with engine.begin() as conn:
        for run_id, fmt in stored.items():
            conn.execute(run_results.insert().values(run_id=run_id, attempt=1, output_digest="-", format=fmt,
                                                     row_count=ROWS, bytes=results.encode_ipc(base)))
        assert evidence.stored_result_digest(conn, "legacy") == BASE_DIGEST_V2
        assert evidence.stored_result_digest(conn, "new") == BASE_DIGEST_V3
        assert evidence.stored_result_digest(conn, "missing") is None
        with pytest.raises(EvidenceError, match="'parquet'"):
            evidence.stored_result_digest(conn, "odd")
    for fmt in (results.FORMAT_IPC_DIGEST_V2, results.FORMAT_IPC_DIGEST_V3):
        assert len(fmt) <= run_results.c.format.type.length


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
