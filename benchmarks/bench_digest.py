"""Benchmark 5: the streaming output digest on a ~200 MB result against raw ``hashlib.sha256`` over its IPC bytes.

The table has an int64, a float64, a string and a nullable int64 column (10 % nulls). It is written
as an Arrow IPC stream in batches of ``BATCH_ROWS`` rows, the size the execution engine streams, and
read back, so every batch has buffers of its own, as a stream delivers them. "Raw" hashes those
IPC bytes in one call; "ours" feeds the batches one by one to an ``OutputDigester`` (format v3),
as the engine will, with its default thread pool and, for context, on one thread. Every figure is
MB of IPC bytes per second, so a ratio is a ratio of times and shows what the digest adds on top of
SHA-256 itself: canonicalisation, length encoding, null fill, per-batch work. The pool needs idle
cores: on a machine busy with other work the one-thread figure is the one to expect.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
from common import BenchContext, print_table, summary, write_result

NAME = "digest"
TARGET_BYTES = {False: 200 * 1024 * 1024, True: 20 * 1024 * 1024}
TARGET_RATIO = 0.95  # streaming digest throughput at least 0.95x raw SHA-256 over the IPC bytes
BATCH_ROWS = 16 * 1024  # the execution engine's result batch size (execution.RESULT_BATCH_ROWS)
SYSTEMS = ("ours", "ours_one_thread", "raw")


def _table(target_bytes: int) -> pa.Table:
    import pyarrow.compute as pc

    # Per row: 8 (int) + 8 (float) + 4 + ~12 (string) + 8 + 1/8 (nullable int) ≈ 40 bytes.
    rows = target_bytes // 40
    ints = pa.array(range(rows), pa.int64())
    floats = pc.random(rows, initializer=7)
    strings = pc.binary_join_element_wise("row-", pc.cast(ints, pa.string()), "")
    nullable = pc.if_else(pc.less(pc.random(rows, initializer=11), 0.1), pa.scalar(None, pa.int64()), ints)
    return pa.table({"id": ints, "x": floats, "s": strings, "n": nullable})


def _stream(table: pa.Table) -> tuple[pa.Buffer, list[pa.RecordBatch]]:
    """The IPC stream bytes of table in BATCH_ROWS-row batches, and the batches read back from them."""
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=BATCH_ROWS):
            writer.write_batch(batch)
    data = sink.getvalue()
    with ipc.open_stream(data) as reader:
        return data, list(reader)


def _streaming_digest(schema: pa.Schema, batches: list[pa.RecordBatch], threads_max: int) -> str:
    from durable_dataflow.dataflow.execution.arrowdigest import OutputDigester

    digester = OutputDigester(schema, threads_max=threads_max)
    for batch in batches:
        digester.update(batch)
    return digester.digest()


def run(ctx: BenchContext) -> dict[str, Any]:
    from durable_dataflow.dataflow.execution.arrowdigest import DIGEST_THREADS_MAX

    threads = {"ours": DIGEST_THREADS_MAX, "ours_one_thread": 1}
    table = _table(TARGET_BYTES[ctx.quick])
    data, batches = _stream(table)
    timings: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    for r in range(ctx.rounds):
        # Rotate the order every round, so no system always runs first (cold) or last.
        for system in SYSTEMS[r % 3 :] + SYSTEMS[: r % 3]:
            began = time.perf_counter()
            if system == "raw":
                hashlib.sha256(memoryview(data)).hexdigest()
            else:
                _streaming_digest(table.schema, batches, threads[system])
            timings[system].append(time.perf_counter() - began)
    medians = {system: statistics.median(values) for system, values in timings.items()}
    ratio = medians["raw"] / medians["ours"]  # throughput ratio: ours / raw
    ratio_one_thread = medians["raw"] / medians["ours_one_thread"]
    mb = data.size / 1e6
    payload = {
        "rounds": ctx.rounds,
        "bytes": data.size,
        "rows": table.num_rows,
        "batch_rows": BATCH_ROWS,
        "batches": len(batches),
        "threads_max": DIGEST_THREADS_MAX,
        "ours_s": summary(timings["ours"]),
        "ours_one_thread_s": summary(timings["ours_one_thread"]),
        "raw_sha256_s": summary(timings["raw"]),
        "ours_mb_per_s": mb / medians["ours"],
        "ours_one_thread_mb_per_s": mb / medians["ours_one_thread"],
        "raw_mb_per_s": mb / medians["raw"],
        "throughput_ratio_ours_over_raw": ratio,
        "throughput_ratio_one_thread_over_raw": ratio_one_thread,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio >= TARGET_RATIO,
    }
    print_table(
        f"Digest of a {mb:,.0f} MB Arrow IPC stream in {len(batches)} batches (median of {ctx.rounds})",
        ["", "seconds", "MB/s", "ours/raw", f"target >= {TARGET_RATIO}x"],
        [
            (f"OutputDigester, {BATCH_ROWS:,}-row batches", medians["ours"], payload["ours_mb_per_s"], ratio,
             ratio >= TARGET_RATIO),
            ("... on one thread (context)", medians["ours_one_thread"], payload["ours_one_thread_mb_per_s"],
             ratio_one_thread, ""),
            ("hashlib.sha256 (IPC bytes)", medians["raw"], payload["raw_mb_per_s"], "", ""),
        ],
    )  # fmt: skip
    write_result(NAME, payload, None, ctx.quick)
    return payload
