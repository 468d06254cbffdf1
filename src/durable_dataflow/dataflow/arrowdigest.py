"""The output digest: a SHA-256 of an Arrow table's schema and values that ignores how it is chunked.

Raw IPC bytes depend on chunking, on the undefined bytes under null slots and on schema metadata
(reference §4), so two producers of the same logical table would disagree. This digest hashes:

1. a header, the canonical JSON of ``{"v": 1, "schema": [[name, type, nullable], ...], "rows": "n"}``
   (metadata excluded; the row count is a string so counts above 2**53 stay hashable);
2. per column, after combining chunks and decoding dictionaries: a marker, the validity as
   packed bits (Arrow's LSB-first bitmap, unused bits zeroed) when there are nulls, then the values with null
   slots filled by the type's zero. Fixed-width values hash exactly their referenced bytes;
   booleans one byte per row; strings and binaries their offsets rebased to 0 in the type's own
   width (int32, or int64 for the large types) and exactly the referenced data bytes.

Floats are hashed by bit pattern, so 0.0 and -0.0 (and NaN payloads) differ. Nested types are
refused: the result schema is declared flat.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import InputError

DIGEST_FORMAT_VERSION = 2
_COLUMN_MARKER = b"\x00col"
_HAS_NULLS = b"V"
_NO_NULLS = b"N"


def _is_variable_width(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
    )


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


def _zero_of(t: pa.DataType) -> pa.Scalar:
    if pa.types.is_boolean(t):
        return pa.scalar(False, type=t)
    if pa.types.is_integer(t) or pa.types.is_decimal(t):
        return pa.scalar(0, type=t)
    if pa.types.is_floating(t):
        return pa.scalar(0.0, type=t)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.scalar("", type=t)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pa.scalar(b"", type=t)
    storage = pa.int64() if t.bit_width == 64 else pa.int32()
    return pa.scalar(0, type=storage).cast(t)


def _fixed_width_view(arr: pa.Array) -> memoryview:
    """Exactly the value bytes the array references (no bytes before its offset or after its end)."""
    width = arr.type.byte_width
    buffer = arr.buffers()[1]
    if buffer is None:  # an empty array may have no value buffer at all
        return memoryview(b"")
    return memoryview(buffer)[arr.offset * width : (arr.offset + len(arr)) * width]


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


def _hash_variable_width(h: Any, arr: pa.Array) -> None:
    """The offsets rebased to 0 (in the type's own width: the type is in the header), then the data."""
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    buffers = arr.buffers()
    offsets = pa.Array.from_buffers(
        pa.int64() if large else pa.int32(), len(arr) + 1, [None, buffers[1]], offset=arr.offset
    )
    start, end = offsets[0].as_py(), offsets[len(arr)].as_py()
    # Combined columns start at offset 0: their offsets are hashed in place, without a copy.
    h.update(_fixed_width_view(offsets if start == 0 else pc.subtract(offsets, start)))
    if buffers[2] is not None and end > start:
        h.update(memoryview(buffers[2])[start:end])


def _hash_column(h: Any, column: pa.ChunkedArray) -> None:
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
        _hash_variable_width(h, arr)
    else:
        h.update(_fixed_width_view(arr))


def output_digest(table: pa.Table) -> str:
    """``sha256:<hex>`` over the schema and values of table, independent of chunking and metadata."""
    for field in table.schema:
        _check_supported(field)
    h = hashlib.sha256()
    header = {
        "v": DIGEST_FORMAT_VERSION,
        "schema": [[f.name, str(f.type), f.nullable] for f in table.schema],
        "rows": str(table.num_rows),
    }
    h.update(hashing.canonical_json(header))
    for column in table.columns:
        _hash_column(h, column)
    return hashing.PREFIX + h.hexdigest()
