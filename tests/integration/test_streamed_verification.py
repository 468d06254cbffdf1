"""Stored results are verified in bounded memory (issue 29, finding 3), on SQLite and PostgreSQL: read
in chunks, digested batch by batch, cached per (run, ledger head), a few at a time."""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core import ledger
from durable_dataflow.dataflow.execution import arrowdigest, results, resultstream
from durable_dataflow.dataflow.protocol import derivation, evidence, views
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.dataflow.schema import run_results
from durable_dataflow.platform import Platform
from support import flows

ROW_BYTES = 100_000


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=5) as opened:
        yield opened


def _run_of(platform: Platform, tmp_path: Path, result_mb: int, key: str = "k") -> Run:
    """An atomic run whose stored result is about ``result_mb`` MB of 100 kB strings (several batches)."""
    rows = result_mb * 1_000_000 // ROW_BYTES
    sql = f"select repeat(chr((65 + (range % 26))::INTEGER), {ROW_BYTES}) || range::varchar as v from range({rows})"
    defn = flows.one_step({}, sql, {"v": "string"}, max_rows=rows, max_bytes=f"{2 * result_mb}MiB")
    run = platform.runs.run_inline(flows.request(defn, tmp_path, key)).run
    assert run.status == "succeeded", run
    return run


def _head(conn: Connection, run_id: str) -> ledger.Entry:
    return ledger.read(conn, "dataflow", run_id)[-1]


def test_streamed_digest_equals_the_whole_table_digest(platform: Platform, tmp_path: Path) -> None:
    """A result stored as several IPC batches, read back in several chunks, digests to the recorded digest
    and to the digest of the whole decoded table; the run verifies."""
    run = _run_of(platform, tmp_path, 10)
    with platform.db.read() as conn:
        whole = results.stored_bytes(conn, run.run_id)
        with results.open_stored(conn, run.run_id) as found:
            assert found is not None
            stored_format, reader = found
            with results.ipc_reader(reader) as batches:
                streamed = arrowdigest.output_digest_of_batches(batches.schema, batches)
            assert reader.chunks_read > 1
        verified = views.verification(conn, run.run_id, None)
    with results.ipc_reader(whole) as batches:
        assert sum(1 for _ in batches) > 1
    assert stored_format == results.STORED_FORMAT
    assert streamed == arrowdigest.output_digest(results.decode_ipc(whole)) == run.output_digest
    assert verified.result.ok, verified


def test_a_tampered_stored_byte_is_detected(platform: Platform, tmp_path: Path) -> None:
    """One byte flipped in the middle of the stored bytes (string data) makes verification fail by digest."""
    run = _run_of(platform, tmp_path, 2)
    with platform.db.read() as conn:
        data = bytearray(results.stored_bytes(conn, run.run_id))
    data[len(data) // 2] ^= 0x01
    with platform.db.begin() as conn:
        conn.execute(sa.update(run_results).where(run_results.c.run_id == run.run_id).values(bytes=bytes(data)))
    with platform.db.read() as conn:
        verified = views.verification(conn, run.run_id, None)
    assert not verified.result.ok
    assert verified.result.reason == "the stored result bytes do not hash to the recorded output digest"


class _Counted:
    """stored_result_digest, counting its calls and, when ``gate`` is set, waiting on it first."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls = 0
        self.gate = gate
        self.entered = threading.Event()

    def __call__(self, conn: Connection, run_id: str) -> str | None:
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(timeout=30)
        return evidence.stored_result_digest(conn, run_id)


def test_the_outcome_is_cached_per_ledger_head(platform: Platform, tmp_path: Path) -> None:
    """A second verification at the same ledger head reads nothing (the counting recompute is not
    called again); once the head moves (an entry appended to the run's chain), it recomputes once."""
    run = _run_of(platform, tmp_path, 1)
    counted = _Counted()
    checks = evidence.ResultChecks(recompute=counted)
    with platform.db.read() as conn:
        first = derivation.verify_run(conn, run, None, checks=checks)
        second = derivation.verify_run(conn, run, None, checks=checks)
    assert first.ok and second.ok and counted.calls == 1
    with platform.db.begin() as conn:
        moved = ledger.append(conn, platform.db, "dataflow", run.run_id, run.attempt, "test.moved", {})
    with platform.db.read() as conn:
        assert _head(conn, run.run_id) == moved
        assert checks.digest(conn, run.run_id, moved) == run.output_digest
        assert checks.digest(conn, run.run_id, moved) == run.output_digest
    assert counted.calls == 2


def test_concurrent_verifications_are_bounded(platform: Platform, tmp_path: Path) -> None:
    """With one slot and no wait, a verification of another head while the first is held inside its
    recompute (on an Event this test sets) is refused with VerificationBusy; once released, both work."""
    run = _run_of(platform, tmp_path, 1)
    gate = threading.Event()
    counted = _Counted(gate)
    checks = evidence.ResultChecks(recompute=counted, at_once_max=1, wait_s=0)
    with platform.db.read() as conn:
        head = _head(conn, run.run_id)
    found: list[str | None] = []

    def first() -> None:
        with platform.db.read() as conn:
            found.append(checks.digest(conn, run.run_id, head))

    holder = threading.Thread(target=first)
    holder.start()
    try:
        assert counted.entered.wait(timeout=30)
        with platform.db.read() as conn, pytest.raises(evidence.VerificationBusy, match="1 stored results"):
            checks.digest(conn, run.run_id, head)
    finally:
        gate.set()
        holder.join(timeout=30)
    assert found == [run.output_digest] and counted.calls == 1
    with platform.db.read() as conn:
        assert checks.digest(conn, run.run_id, head) == run.output_digest  # from the cache: no slot needed


def test_verification_memory_is_bounded_by_a_batch_not_the_result(platform: Platform, tmp_path: Path) -> None:
    """Verifying a ~24 MB stored result allocates under 12 MB at its peak, in Python objects (tracemalloc)
    and in Arrow's pool (a proxy pool of its own, its max_memory): the whole result is never held."""
    run = _run_of(platform, tmp_path, 24)
    bound = 12_000_000
    with platform.db.read() as conn:
        size = len(results.stored_bytes(conn, run.run_id))
    assert size > 2 * bound
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        with platform.db.read() as conn:
            verified = views.verification(conn, run.run_id, None)
        traced_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(previous)
    assert verified.result.ok, verified
    assert traced_peak < bound, traced_peak
    assert pool.max_memory() < bound, pool.max_memory()
    assert bound > resultstream.IPC_BATCH_BYTES_MAX + results.READ_CHUNK_BYTES
