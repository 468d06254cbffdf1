"""The bounded result, built while the engine's record batches arrive (DESIGN §11).

Whatever engine produced them, batches are cast to the declared schema, counted against
``output.max_rows``, appended to the Arrow IPC stream that will be stored (and counted against
``output.max_bytes`` as it grows) and fed to the output digest, one batch at a time: memory is
bounded by the limit plus one batch, never by what the query would produce, and no second pass
over the result is made.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.ipc as ipc

from durable_dataflow.core.errors import ExecutionError, LimitExceeded
from durable_dataflow.dataflow.execution import arrowdigest


@dataclass(frozen=True)
class BoundedResult:
    """The stored bytes of a result and what describes them."""

    ipc_bytes: memoryview  # a view of the IPC stream's one Arrow buffer: no copy into a Python bytes object
    row_count: int
    output_digest: str


def check_columns(schema: pa.Schema, declared: pa.Schema, step: str) -> None:
    """Names and order must match before any batch is read."""
    if schema.names != declared.names:
        # Only declared names are shown: the others may come from a source's header (file contents).
        missing = [n for n in declared.names if n not in schema.names]
        undeclared = sum(1 for n in schema.names if n not in declared.names)
        problem = (
            f"lacks the declared columns {missing} and has {undeclared} undeclared column(s)"
            if missing or undeclared
            else "has the declared columns in another order"
        )
        raise ExecutionError(
            f"the result of step {step!r} {problem}: output.schema declares {declared.names}, in that order"
        )


def _cast_column(name: str, column: pa.Array, declared: pa.DataType) -> pa.Array:
    actual = column.type
    if actual == declared:
        return column
    if pa.types.is_floating(actual) and pa.types.is_decimal(declared):
        raise ExecutionError(
            f"column {name!r} is {actual} but the schema declares {declared}: a float-to-decimal cast "
            f"rounds silently, so cast in SQL instead (e.g. {name}::DECIMAL({declared.precision},{declared.scale}))"
        )
    try:
        return column.cast(declared, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        # Arrow's reason quotes the offending value ("Failed to parse string: 'x'"): the kind only.
        raise ExecutionError(
            f"column {name!r} is {actual} and cannot be cast to the declared {declared} "
            f"({type(exc).__name__}: a value does not fit the declared type)"
        ) from None


def cast_batch(batch: pa.RecordBatch, declared: pa.Schema) -> pa.RecordBatch:
    """batch cast column by column to the declared schema (names and order already checked)."""
    if batch.schema.equals(declared):
        return batch
    columns = [_cast_column(f.name, batch.column(i), f.type) for i, f in enumerate(declared)]
    return pa.RecordBatch.from_arrays(columns, schema=declared)


IPC_BATCH_BYTES_MAX = 4 << 20  # a stored record batch holds about this many bytes at most (unless one row is larger)


def _pieces(batch: pa.RecordBatch) -> list[pa.RecordBatch]:
    """batch as slices (views, not copies) of about ``IPC_BATCH_BYTES_MAX`` bytes each, so a reader of
    the stored stream (verification, batch by batch) holds one such piece at a time, however many
    rows the engine put in one batch. The digest does not depend on how rows are split."""
    size = batch.nbytes
    if size <= IPC_BATCH_BYTES_MAX or batch.num_rows <= 1:
        return [batch]
    rows = max(1, batch.num_rows * IPC_BATCH_BYTES_MAX // size)
    return [batch.slice(start, rows) for start in range(0, batch.num_rows, rows)]


class ResultCollector:
    """Consumes batches under the bounds; ``rows`` and ``bytes`` may be read from another thread."""

    def __init__(self, declared: pa.Schema, rows_max: int, bytes_max: int, bytes_limit_text: str) -> None:
        self.declared = declared
        self.rows_max = rows_max
        self.bytes_max = bytes_max
        self.bytes_limit_text = bytes_limit_text  # how the user wrote the bound, e.g. 'output.max_bytes = 64MiB'
        self.rows = 0
        self.bytes = 0
        self._digester = arrowdigest.OutputDigester(declared)
        self._sink = pa.BufferOutputStream()
        self._writer = ipc.new_stream(self._sink, declared)

    def add(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows
        if self.rows > self.rows_max:
            raise LimitExceeded(
                f"the result has more than output.max_rows = {self.rows_max} rows (stopped reading at {self.rows})"
            )
        typed = cast_batch(batch, self.declared)
        # The IPC form of a flat batch holds at least its value buffers: when those alone pass the
        # bound, refuse before encoding it (one copy fewer of the largest batch).
        if self.bytes + typed.nbytes > self.bytes_max:
            self.bytes += typed.nbytes
            self._check_bytes()
        for piece in _pieces(typed):
            self._writer.write_batch(piece)
            self.bytes = self._sink.tell()
            self._check_bytes()
            self._digester.update(piece)

    def _check_bytes(self) -> None:
        if self.bytes > self.bytes_max:
            raise LimitExceeded(
                f"the result is more than {self.bytes_limit_text} ({self.bytes_max} bytes) as Arrow IPC "
                f"(stopped reading at {self.rows} rows)"
            )

    def add_all(self, batches: Iterable[pa.RecordBatch]) -> None:
        for batch in batches:
            self.add(batch)

    def finish(self) -> BoundedResult:
        self._writer.close()
        self.bytes = self._sink.tell()
        self._check_bytes()
        # The sink's buffer itself (a view keeps it alive), handed down to the driver that stores it:
        # to_pybytes() would hold a second copy of the result while the first is still referenced.
        data = memoryview(self._sink.getvalue()).cast("B")
        return BoundedResult(ipc_bytes=data, row_count=self.rows, output_digest=self._digester.digest())
