"""The output digest: a SHA-256 of an Arrow table's schema and values that ignores how it is chunked.

Raw IPC bytes depend on chunking, on the undefined bytes under null slots and on schema metadata
(reference §4), so two producers of the same logical table would disagree. Format v3 is computed
by :class:`OutputDigester` as record batches stream in, with no second pass. It keeps, per column,
SHA-256 streams whose bytes are a function of the column's whole sequence of values, never of
where the batches split it:

- *validity*: the column's validity as one packed bitmap, LSB first, contiguous across batches (a
  batch's leftover bits are carried into the next), with the unused bits of the last byte zero.
  Only a column that holds a null somewhere has this stream; it starts at the first batch with a
  null, after first being fed the all-valid prefix;
- *values*, with null slots filled by the type's zero (dictionaries decoded per batch): fixed-width
  types (integers, floats, dates, timestamps, decimals) exactly their referenced value bytes;
  booleans their values as packed bits, like validity; strings and binaries two streams, the
  value *lengths* in the type's offset width (int32, or int64 for the large types) and exactly the
  referenced data bytes. Lengths, unlike offsets, do not depend on where a batch starts.

The digest is SHA-256 over the canonical JSON header ``{"v": 3, "schema": [[name, str(type),
nullable], ...], "rows": "n"}`` (metadata excluded; the row count is a string so counts above
2**53 stay hashable), then per column in schema order: ``\\x00col``, then ``V`` and the validity
stream's 32-byte digest or ``N`` for a column without nulls, then the 32-byte digests of its value
streams (one, or lengths then data for strings and binaries). Every stream digest has a fixed size
and the type in the header fixes how many follow, so the framing is unambiguous.

Floats are hashed by bit pattern, so 0.0 and -0.0 (and NaN payloads) differ. Nested types are
refused: the result schema is declared flat.

:func:`output_digest_v2` is the format before v3, kept only to verify results stored under it
(``results.FORMAT_IPC_DIGEST_V2``). It hashes whole columns in turn after combining chunks, into
one stream: header ``"v": 2``, then per column the marker, ``V`` and the packed validity bitmap or
``N``, then the values inline: booleans one byte per row, strings and binaries their offsets
rebased to 0 then their data. Because one stream takes a whole column before the next (and a
column's ``V``/``N`` marker and validity before its values), v2 cannot be computed in one pass over
batches: it needs the whole table (or one pass over the stored bytes per column and stream), so a
result stored under v2 is still verified with its table in memory.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.invariants import invariant

DIGEST_FORMAT_VERSION = 3
_V2_FORMAT_VERSION = 2  # only output_digest_v2 writes it into its header
_COLUMN_MARKER = b"\x00col"
_HAS_NULLS = b"V"
_NO_NULLS = b"N"
_ONES_CHUNK_BYTES = 1 << 20  # an all-valid run of validity is fed in pieces of at most this size
_GROUP_ROWS = 262_144  # small batches are hashed in groups of at least this many rows ...
_GROUP_BYTES_MAX = 16 << 20  # ... or of at most about this many buffer bytes, whichever comes first
# A reader's batches are each a fresh allocation, so the group it holds is memory of its own: smaller.
_STREAM_GROUP_BYTES_MAX = 4 << 20
DIGEST_THREADS_MAX = 4  # columns hashed at once (never more than the cores): hashlib and Arrow release the GIL
_PARALLEL_ROWS_MIN = 32_768  # a smaller group is hashed on the caller's thread: dispatch would cost more


class _Kind(enum.Enum):
    FIXED = "fixed"  # integers, floats, dates, timestamps, decimals: the value bytes
    BOOLEAN = "boolean"  # the values as packed bits
    VARIABLE = "variable"  # strings and binaries: the lengths, and the data bytes


def _is_variable_width(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
    )


def _has_large_offsets(t: pa.DataType) -> bool:
    """Whether t's offsets are 64-bit (large string, large binary) rather than 32-bit."""
    return bool(pa.types.is_large_string(t) or pa.types.is_large_binary(t))


def _check_supported(field: pa.Field) -> None:
    t = field.type
    if pa.types.is_dictionary(t):
        t = t.value_type
    fixed = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
    temporal = pa.types.is_date(t) or pa.types.is_timestamp(t)
    if not (fixed or temporal or pa.types.is_boolean(t) or _is_variable_width(t)):
        raise InputError(
            f"column {field.name!r} has type {t}, which the output digest does not support: "
            "declare a flat type (string, integers, floats, bool, date, timestamp, decimal)"
        )


@functools.lru_cache(maxsize=256)
def _zero_of(t: pa.DataType) -> pa.Scalar:
    """The zero of t (False, 0, 0.0, "", b"", the epoch), read from one row of zeroed buffers; kept per
    type (a scalar is immutable), since every digest of every result asks for its columns' zeros.

    ``pa.scalar`` on a Python value would make pyarrow look for pandas, which costs ≈ 0.2 s where
    pandas is installed, on every ``dataflow verify``; buffers never do."""
    return pa.Array.from_buffers(t, 1, [None, *_zero_buffers(t)])[0]


def _zero_buffers(t: pa.DataType) -> list[pa.Buffer]:
    if _is_variable_width(t):
        offset_bytes = 8 if _has_large_offsets(t) else 4
        return [pa.py_buffer(bytes(2 * offset_bytes)), pa.py_buffer(b"")]  # offsets 0, 0 and no data
    return [pa.py_buffer(bytes(max(1, t.bit_width // 8)))]  # a boolean's one bit lives in a byte


def _fixed_width_view(arr: pa.Array) -> memoryview:
    """Exactly the value bytes the array references (no bytes before its offset or after its end)."""
    width = arr.type.byte_width
    buffer = arr.buffers()[1]
    if buffer is None:  # an empty array may have no value buffer at all
        return memoryview(b"")
    return memoryview(buffer)[arr.offset * width : (arr.offset + len(arr)) * width]


class _BitStream:
    """A SHA-256 of a sequence of bits as one LSB-first bitmap, however the sequence is split."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._pending = 0  # the bits of the unfinished last byte, LSB first
        self._pending_bits = 0  # how many there are, 0 to 7
        self.bits = 0  # bits fed so far

    def _push(self, value: int, n: int) -> None:
        """Append the n low bits of value; the Python int does the shifting across byte boundaries."""
        combined = self._pending | (value << self._pending_bits)
        total = self._pending_bits + n
        data = combined.to_bytes(total // 8 + 1, "little")
        self._hash.update(data[:-1])
        self._pending, self._pending_bits = data[-1], total % 8
        self.bits += n

    def bitmap(self, buffer: pa.Buffer, offset: int, n: int) -> None:
        """Append bits offset to offset + n of an Arrow bitmap."""
        first, shift = divmod(offset, 8)
        view = memoryview(buffer)[first : first + (shift + n + 7) // 8]
        if shift or self._pending_bits:
            self._push((int.from_bytes(view, "little") >> shift) & ((1 << n) - 1), n)
            return
        # Byte-aligned on both sides, the common case: the whole bytes are hashed in place.
        whole, rest = divmod(n, 8)
        self._hash.update(view[:whole])
        self.bits += whole * 8
        if rest:
            self._push(view[whole] & ((1 << rest) - 1), rest)  # the bits past n belong to others

    def ones(self, n: int) -> None:
        """Append n one bits (an all-valid run)."""
        if self._pending_bits:
            head = min(n, 8 - self._pending_bits)
            self._push((1 << head) - 1, head)
            n -= head
        if n == 0:
            return
        whole, rest = divmod(n, 8)
        while whole:
            piece = min(whole, _ONES_CHUNK_BYTES)
            self._hash.update(b"\xff" * piece)
            self.bits += piece * 8
            whole -= piece
        if rest:
            self._push((1 << rest) - 1, rest)

    def finish(self) -> bytes:
        """The 32-byte digest, the last byte's unused bits zero; the stream is spent afterwards."""
        if self._pending_bits:
            self._hash.update(bytes([self._pending]))
        return self._hash.digest()


class _Column:
    """One column's streams: validity (from its first null on) and its values."""

    def __init__(self, field: pa.Field) -> None:
        self.dictionary = pa.types.is_dictionary(field.type)
        self.value_type = field.type.value_type if self.dictionary else field.type
        self.zero = _zero_of(self.value_type)
        if pa.types.is_boolean(self.value_type):
            self.kind = _Kind.BOOLEAN
        elif _is_variable_width(self.value_type):
            self.kind = _Kind.VARIABLE
        else:
            self.kind = _Kind.FIXED
        large = _has_large_offsets(self.value_type)
        self.offset_format = "<q" if large else "<i"
        self.length_zero = _zero_of(pa.int64() if large else pa.int32())
        self.rows = 0
        self.validity: _BitStream | None = None  # None while every row so far is valid
        self.values = hashlib.sha256()  # fixed-width value bytes, or string lengths
        self.value_bits = _BitStream()  # boolean values
        self.data = hashlib.sha256()  # string and binary data bytes

    def update(self, column: pa.ChunkedArray) -> None:
        """Hash the next rows: one column of a group of batches, its chunks in order."""
        if self.dictionary:
            column = pa.chunked_array([c.dictionary_decode() for c in column.chunks], self.value_type)
        nulls = column.null_count
        self._update_validity(column, nulls)
        if self.kind is _Kind.VARIABLE:
            self._update_variable(column, nulls)
        else:
            # One kernel call for the whole group: each call has a fixed cost of several microseconds.
            filled = pc.coalesce(column, self.zero) if nulls else column
            for chunk in filled.chunks:
                if self.kind is _Kind.FIXED:
                    self.values.update(_fixed_width_view(chunk))
                elif len(chunk):
                    self.value_bits.bitmap(chunk.buffers()[1], chunk.offset, len(chunk))
        self.rows += len(column)

    def _update_validity(self, column: pa.ChunkedArray, nulls: int) -> None:
        if self.validity is None:
            if not nulls:
                return
            self.validity = _BitStream()
            self.validity.ones(self.rows)
        if not nulls:
            self.validity.ones(len(column))
            return
        for chunk in column.chunks:
            if chunk.null_count:
                self.validity.bitmap(chunk.buffers()[0], chunk.offset, len(chunk))
            else:
                self.validity.ones(len(chunk))

    def _data_ranges(self, column: pa.ChunkedArray) -> list[tuple[pa.Buffer, int, int]]:
        """Per non-empty chunk: its data buffer and the byte range its values reference there."""
        width = struct.calcsize(self.offset_format)
        ranges = []
        for chunk in column.chunks:
            if len(chunk):
                _, offsets, data = chunk.buffers()
                start = struct.unpack_from(self.offset_format, offsets, chunk.offset * width)[0]
                end = struct.unpack_from(self.offset_format, offsets, (chunk.offset + len(chunk)) * width)[0]
                ranges.append((data, int(start), int(end)))
        return ranges

    def _update_variable(self, column: pa.ChunkedArray, nulls: int) -> None:
        lengths = pc.binary_length(column)  # int32, or int64 for the large types: the offset width
        if nulls:
            lengths = pc.coalesce(lengths, self.length_zero)
        ranges = self._data_ranges(column)
        if nulls and pc.sum(lengths).as_py() != sum(end - start for _, start, end in ranges):
            # Some null slots span data bytes (Arrow leaves them undefined): drop them by filling.
            ranges = self._data_ranges(pc.coalesce(column, self.zero))
        for chunk in lengths.chunks:
            self.values.update(_fixed_width_view(chunk))
        for data, start, end in ranges:
            if end > start:
                self.data.update(memoryview(data)[start:end])

    def finish(self) -> bytes:
        """The column's section of the final hash: marker, validity, then the value stream digests."""
        parts = [_COLUMN_MARKER]
        if self.validity is None:
            parts.append(_NO_NULLS)
        else:
            invariant(self.validity.bits == self.rows, "the validity stream has one bit per row")
            parts += [_HAS_NULLS, self.validity.finish()]
        if self.kind is _Kind.BOOLEAN:
            invariant(self.value_bits.bits == self.rows, "the boolean value stream has one bit per row")
            parts.append(self.value_bits.finish())
        elif self.kind is _Kind.VARIABLE:
            parts += [self.values.digest(), self.data.digest()]
        else:
            parts.append(self.values.digest())
        return b"".join(parts)


class OutputDigester:
    """The v3 output digest, computed while record batches of one schema stream in.

    Feed every batch to :meth:`update`, in order, then call :meth:`digest` once. The digest is the
    same however the rows are split into batches (zero-row batches included). :meth:`digest` ends
    the digester: any later :meth:`update` or :meth:`digest` is a bug and raises InvariantViolation.

    Small batches are held (by reference, never copied) until a group of them reaches
    ``_GROUP_ROWS`` rows or ``group_bytes_max`` bytes, then hashed together, so the fixed cost of
    each Arrow kernel call and Python step is paid per group, not per batch. A group's columns are
    hashed by at most ``threads_max`` threads of the digester's own pool (started on the first
    large group, stopped by :meth:`digest` or when the digester is collected). Each column's
    streams are fed by one task at a time, in order, and the next group waits for every column, so
    the bytes each stream sees, and thus the digest, do not depend on the threads. After
    :meth:`update` raised, discard the digester.
    """

    def __init__(
        self, schema: pa.Schema, *, threads_max: int = DIGEST_THREADS_MAX, group_bytes_max: int = _GROUP_BYTES_MAX
    ) -> None:
        for field in schema:
            _check_supported(field)
        self._schema = schema
        self._columns = [_Column(field) for field in schema]
        self._threads = max(1, min(len(self._columns), os.cpu_count() or 1, threads_max))
        self._pool: ThreadPoolExecutor | None = None
        self._group: list[pa.RecordBatch] = []
        self._group_rows = 0
        self._group_bytes = 0
        self._group_bytes_max = group_bytes_max
        self._rows = 0
        self._done = False

    @property
    def rows(self) -> int:
        """Rows taken so far, including those held and not yet hashed."""
        return self._rows

    def update(self, batch: pa.RecordBatch) -> None:
        """Take one batch; it must have exactly the digester's schema (metadata aside)."""
        invariant(not self._done, "OutputDigester.update after digest(): the digester is spent")
        if not batch.schema.equals(self._schema):
            raise InputError(f"a record batch has schema {batch.schema}, not the digested schema {self._schema}")
        # A large batch is hashed in slices (no copy), so the null fill allocates one slice's worth
        # at a time, not a copy of the whole column.
        for offset in range(0, batch.num_rows, _GROUP_ROWS):
            self._hold(batch.slice(offset, _GROUP_ROWS))

    def _hold(self, batch: pa.RecordBatch) -> None:
        self._group.append(batch)
        self._group_rows += batch.num_rows
        # An upper bound (a slice counts its whole buffers), so the memory held stays bounded.
        self._group_bytes += batch.get_total_buffer_size()
        self._rows += batch.num_rows
        if self._group_rows >= _GROUP_ROWS or self._group_bytes >= self._group_bytes_max:
            self._hash_group()

    def _hash_group(self) -> None:
        if not self._group:
            return
        group = pa.Table.from_batches(self._group, schema=self._schema)  # no copy: the batches' chunks
        if self._threads > 1 and self._group_rows >= _PARALLEL_ROWS_MIN:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="output-digest")
            for _ in self._pool.map(_Column.update, self._columns, group.columns):
                pass  # map yields in column order once each column is done, re-raising its exception
        else:
            for column, chunked in zip(self._columns, group.columns, strict=True):
                column.update(chunked)
        self._group, self._group_rows, self._group_bytes = [], 0, 0

    def digest(self) -> str:
        """``sha256:<hex>`` over the header and every column's streams; call it once, at the end."""
        invariant(not self._done, "OutputDigester.digest called twice: the digester is spent")
        self._done = True
        try:
            self._hash_group()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
        header = {
            "v": DIGEST_FORMAT_VERSION,
            "schema": [[f.name, str(f.type), f.nullable] for f in self._schema],
            "rows": str(self._rows),
        }
        h = hashlib.sha256(hashing.canonical_json(header))
        for column in self._columns:
            invariant(column.rows == self._rows, "every column saw every row")
            h.update(column.finish())
        return hashing.PREFIX + h.hexdigest()


def output_digest(table: pa.Table) -> str:
    """``sha256:<hex>`` (format v3) over the schema and values of table, independent of chunking and metadata."""
    digester = OutputDigester(table.schema)
    for batch in table.to_batches():
        digester.update(batch)
    invariant(digester.rows == table.num_rows, "the batches hold every row of the table")
    return digester.digest()


def output_digest_of_batches(schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> str:
    """:func:`output_digest` of the table these batches form, taken one at a time as they arrive (from
    a stream reader): the digest holds at most one group of them (``_STREAM_GROUP_BYTES_MAX`` and the
    batch that fills it), never the table."""
    digester = OutputDigester(schema, group_bytes_max=_STREAM_GROUP_BYTES_MAX)
    for batch in batches:
        digester.update(batch)
    return digester.digest()


# ---- format v2: only to verify results stored before v3 -----------------------------------------


def _packed_bits(bits: pa.BooleanArray) -> bytes:
    """The bitmap of a boolean array, LSB first, with the unused bits of the last byte zeroed."""
    n = len(bits)
    if bits.offset % 8:
        bits = pa.concat_arrays([bits])  # realign; rare, since kernels return offset 0
    nbytes = (n + 7) // 8
    data = bytearray(memoryview(bits.buffers()[1])[bits.offset // 8 : bits.offset // 8 + nbytes])
    if n % 8:
        data[-1] &= (1 << (n % 8)) - 1
    return bytes(data)


def _hash_variable_width_v2(h: Any, arr: pa.Array) -> None:
    """The offsets rebased to 0 (in the type's own width: the type is in the header), then the data."""
    large = _has_large_offsets(arr.type)
    buffers = arr.buffers()
    offsets = pa.Array.from_buffers(
        pa.int64() if large else pa.int32(), len(arr) + 1, [None, buffers[1]], offset=arr.offset
    )
    start, end = offsets[0].as_py(), offsets[len(arr)].as_py()
    # Combined columns start at offset 0: their offsets are hashed in place, without a copy.
    h.update(_fixed_width_view(offsets if start == 0 else pc.subtract(offsets, start)))
    if buffers[2] is not None and end > start:
        h.update(memoryview(buffers[2])[start:end])


def _hash_column_v2(h: Any, column: pa.ChunkedArray) -> None:
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    h.update(_COLUMN_MARKER)
    if arr.null_count:
        h.update(_HAS_NULLS)
        h.update(_packed_bits(arr.is_valid()))
        arr = arr.fill_null(_zero_of(arr.type))
    else:
        h.update(_NO_NULLS)
    if pa.types.is_boolean(arr.type):
        h.update(_fixed_width_view(pc.cast(arr, pa.uint8())))
    elif _is_variable_width(arr.type):
        _hash_variable_width_v2(h, arr)
    else:
        h.update(_fixed_width_view(arr))


def output_digest_v2(table: pa.Table) -> str:
    """``sha256:<hex>`` in format v2: only to verify results stored as ``arrow-ipc-stream`` before v3."""
    for field in table.schema:
        _check_supported(field)
    h = hashlib.sha256()
    header = {
        "v": _V2_FORMAT_VERSION,
        "schema": [[f.name, str(f.type), f.nullable] for f in table.schema],
        "rows": str(table.num_rows),
    }
    h.update(hashing.canonical_json(header))
    for column in table.columns:
        _hash_column_v2(h, column)
    return hashing.PREFIX + h.hexdigest()
