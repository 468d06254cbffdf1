"""Benchmark 5: ``output_digest`` on a ~200 MB result against raw ``hashlib.sha256`` over its bytes.

The table has an int64, a float64, a string and a nullable int64 column. "Raw" hashes exactly the
value buffers the digest has to read (validity, values, string offsets and data), so the ratio
shows what the digest adds on top of SHA-256 itself: canonicalisation, length encoding, null fill.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any

import pyarrow as pa
from common import BenchContext, print_table, summary, write_result

NAME = "digest"
TARGET_BYTES = {False: 200 * 1024 * 1024, True: 20 * 1024 * 1024}
TARGET_RATIO = 0.8  # digest throughput at least 0.8x raw hashing


def _table(target_bytes: int) -> pa.Table:
    import pyarrow.compute as pc

    # Per row: 8 (int) + 8 (float) + 4 + ~12 (string) + 8 + 1/8 (nullable int) ≈ 40 bytes.
    rows = target_bytes // 40
    ints = pa.array(range(rows), pa.int64())
    floats = pc.random(rows, initializer=7)
    strings = pc.binary_join_element_wise("row-", pc.cast(ints, pa.string()), "")
    nullable = pc.if_else(pc.less(pc.random(rows, initializer=11), 0.1), pa.scalar(None, pa.int64()), ints)
    return pa.table({"id": ints, "x": floats, "s": strings, "n": nullable})


def _raw_buffers(table: pa.Table) -> list[Any]:
    views = []
    for column in table.columns:
        for chunk in column.chunks:
            views.extend(memoryview(b) for b in chunk.buffers() if b is not None)
    return views


def _raw_hash(buffers: list[Any]) -> str:
    h = hashlib.sha256()
    for view in buffers:
        h.update(view)
    return h.hexdigest()


def run(ctx: BenchContext) -> dict[str, Any]:
    from durable_dataflow.dataflow.arrowdigest import output_digest

    table = _table(TARGET_BYTES[ctx.quick])
    buffers = _raw_buffers(table)
    nbytes = sum(len(b) for b in buffers)
    ours, raw = [], []
    for r in range(ctx.rounds):
        for system in (("ours", "raw") if r % 2 == 0 else ("raw", "ours")):
            began = time.perf_counter()
            if system == "ours":
                output_digest(table)
                ours.append(time.perf_counter() - began)
            else:
                _raw_hash(buffers)
                raw.append(time.perf_counter() - began)
    ratio = statistics.median(raw) / statistics.median(ours)  # throughput ratio: ours / raw
    mb = nbytes / 1e6
    payload = {
        "rounds": ctx.rounds,
        "bytes": nbytes,
        "rows": table.num_rows,
        "ours_s": summary(ours),
        "raw_sha256_s": summary(raw),
        "ours_mb_per_s": mb / statistics.median(ours),
        "raw_mb_per_s": mb / statistics.median(raw),
        "throughput_ratio_ours_over_raw": ratio,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio >= TARGET_RATIO,
    }
    print_table(
        f"Digest of a {mb:,.0f} MB Arrow table (median of {ctx.rounds})",
        ["", "seconds", "MB/s", "ours/raw", f"target >= {TARGET_RATIO}x"],
        [
            ("output_digest", statistics.median(ours), payload["ours_mb_per_s"], ratio, ratio >= TARGET_RATIO),
            ("hashlib.sha256 (raw buffers)", statistics.median(raw), payload["raw_mb_per_s"], "", ""),
        ],
    )
    write_result(NAME, payload, None, ctx.quick)
    return payload
