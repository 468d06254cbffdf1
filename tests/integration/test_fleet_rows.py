"""The fleet table on SQLite and PostgreSQL (issue 33): a worker registers, beats and marks its row stopped;
liveness follows the TTL, and old rows are pruned."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_dataflow.dataflow.protocol import fleet
from durable_dataflow.dataflow.protocol.fleet import WorkerState
from durable_dataflow.dataflow.worker import Worker, WorkerOptions
from durable_dataflow.platform import Platform
from faults import harness

WAIT_S = 30.0


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url) as opened:
        yield opened


def _row(platform: Platform, holder: str) -> fleet.WorkerView | None:
    return next((w for w in fleet.list_workers(platform.db) if w.holder == holder), None)


def test_a_running_worker_beats_its_row_and_marks_it_stopped(platform: Platform, tmp_path: Path) -> None:
    """A worker loop in a thread (TTL 0.6 s: a beat every 0.2 s) registers its row (role worker, its pid,
    concurrency 2, alive), beats it (the beat time moves on while it idles), and on stop the row reads
    stopped, never dead, even once its TTL has long passed on the database clock."""
    options = WorkerOptions(concurrency=2, poll_interval_s=0.05, worker_ttl_s=0.6)
    worker = Worker(platform.runs, options)
    holder = platform.runs.config.holder
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        harness.wait_until(lambda: _row(platform, holder) is not None, WAIT_S, "the row")
        first = _row(platform, holder)
        assert first is not None and first.state == WorkerState.ALIVE, first
        assert (first.role, first.concurrency, first.inflight, first.ttl_s) == ("worker", 2, 0, 0.6)
        harness.wait_until(
            lambda: (row := _row(platform, holder)) is not None and row.beat_at_us > first.beat_at_us, WAIT_S, "a beat"
        )
    finally:
        worker.request_stop()
        thread.join(WAIT_S)
    stopped = _row(platform, holder)
    assert stopped is not None and stopped.state == WorkerState.STOPPED and stopped.stopped_at_us is not None
    platform.db.advance_clock(60)
    again = _row(platform, holder)
    assert again is not None and again.state == WorkerState.STOPPED


def test_a_row_without_beats_reads_dead_after_its_ttl_and_is_pruned(platform: Platform) -> None:
    """A registered row that is never beaten again (its process died without a word) reads alive within its
    TTL and dead after it (the database clock moved past the TTL); a registration after the retention has
    passed prunes it."""
    fleet.register(
        platform.db, holder="gone:1:aa", role=fleet.Role.WORKER, concurrency=1, ttl_s=5.0, holder_locked=False
    )
    assert _row(platform, "gone:1:aa").state == WorkerState.ALIVE  # type: ignore[union-attr]
    platform.db.advance_clock(6)
    assert _row(platform, "gone:1:aa").state == WorkerState.DEAD  # type: ignore[union-attr]
    platform.db.advance_clock(fleet.ROW_RETENTION_S)
    fleet.register(
        platform.db, holder="new:2:bb", role=fleet.Role.SWEEPER, concurrency=1, ttl_s=5.0, holder_locked=False
    )
    assert [w.holder for w in fleet.list_workers(platform.db)] == ["new:2:bb"]


def test_liveness_decision_table() -> None:
    """state_of: stopped wins; a released holder lock or a beat older than the TTL is dead; else alive."""
    assert fleet.state_of("stopped", 999.0, 1.0, True) == WorkerState.STOPPED
    assert fleet.state_of("running", 0.1, 10.0, True) == WorkerState.DEAD
    assert fleet.state_of("running", 10.5, 10.0, False) == WorkerState.DEAD
    assert fleet.state_of("running", 9.5, 10.0, False) == WorkerState.ALIVE


def test_the_serve_sweeper_keeps_a_sweeper_row(platform: Platform) -> None:
    """`dataflow serve`'s sweeper registers its row (role sweeper, alive) at its first sweep, with a TTL of at
    least three sweep intervals (so a long interval never reads dead), and marks it stopped on stop."""
    from durable_dataflow.cli.server_cmd import ServeSweeper

    sweeping = ServeSweeper(platform, 30.0)
    sweeping.sweep_once()
    row = _row(platform, platform.runs.config.holder)
    assert row is not None and (row.role, row.state) == ("sweeper", WorkerState.ALIVE), row
    assert row.ttl_s >= 90.0
    sweeping.stop()
    stopped = _row(platform, platform.runs.config.holder)
    assert stopped is not None and stopped.state == WorkerState.STOPPED
