"""The process's one watcher thread (dataflow.execution.watcher) and the DuckDB execution's watch on it.

Each execution used to start and join a thread of its own: two thread hand-offs a run, each waiting for a
core on a busy host. These tests hold the shared thread to what the per-execution one did: due work is
done on time, even when it is due before everything already watched; nothing is touched or held once its
execution ended."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import duckdb
from structlog.testing import capture_logs

from durable_dataflow.dataflow.execution import duckdb_engine, interruption, watcher
from durable_dataflow.dataflow.execution.limits import ExecutionLimits

WAIT_S = 10.0
HOUR_S = 3600.0


class _Ticks:
    """A watched thing that records its ticks and asks to be woken again ``every`` seconds (None: once)."""

    def __init__(self, every: float | None = None) -> None:
        self.every = every
        self.ticked = threading.Event()
        self.count = 0

    def tick(self, now: float) -> float | None:
        self.count += 1
        self.ticked.set()
        return None if self.every is None else now + self.every


def _wait_ticks(watched: _Ticks, count: int, failure: str) -> None:
    """Until ``watched`` was ticked ``count`` times (a bounded wait on its tick event, never a sleep)."""
    deadline = time.monotonic() + WAIT_S
    while watched.count < count:
        assert time.monotonic() < deadline, failure
        watched.ticked.wait(0.05)


def test_work_due_before_everything_watched_wakes_the_thread() -> None:
    """Proves a watch due now is ticked at once although the thread sleeps toward one due in an hour
    (fails when an earlier instant does not wake the thread)."""
    shared = watcher.Watcher()
    late, soon = _Ticks(), _Ticks()
    shared.add(late, time.monotonic() + HOUR_S)
    assert not late.ticked.wait(0.05)  # the thread is now asleep until the hour
    shared.add(soon, time.monotonic())
    assert soon.ticked.wait(WAIT_S), "a watch due now waited behind one due in an hour"
    assert not late.ticked.is_set()
    shared.remove(late)
    shared.remove(soon)
    assert shared.watched() == 0


def test_a_watch_removed_while_it_ticks_is_not_scheduled_again() -> None:
    """Proves a watch removed during its own tick is dropped, not held until its next instant (fails
    when the thread puts it back in the schedule after the tick)."""
    shared = watcher.Watcher()
    entered, release = threading.Event(), threading.Event()

    class Slow(_Ticks):
        def tick(self, now: float) -> float | None:
            entered.set()
            release.wait(WAIT_S)
            return now + HOUR_S

    slow = Slow()
    shared.add(slow, time.monotonic())
    assert entered.wait(WAIT_S)
    shared.remove(slow)  # while its tick is under way
    release.set()
    follower = _Ticks()
    shared.add(follower, time.monotonic())  # ticked after the thread handled the slow one's return
    assert follower.ticked.wait(WAIT_S)
    shared.remove(follower)
    assert shared.watched() == 0
    assert all(entry[2] is not slow for entry in shared._schedule), "the removed watch was scheduled again"


def test_a_watch_is_ticked_again_at_the_instant_it_asks_for() -> None:
    shared = watcher.Watcher()
    repeating = _Ticks(every=0.01)
    shared.add(repeating, time.monotonic())
    _wait_ticks(repeating, 3, "the watch was not ticked again")
    shared.remove(repeating)


class _Connection:
    """Stands in for a DuckDB connection: counts interrupts; ``repeated`` is set at the second one."""

    def __init__(self) -> None:
        self.interrupts = 0
        self.repeated = threading.Event()

    def interrupt(self) -> None:
        self.interrupts += 1
        if self.interrupts >= 2:
            self.repeated.set()


def _watch(con: Any, deadline_at: float, interrupted: interruption.Interruption | None = None) -> duckdb_engine._Watch:
    return duckdb_engine._Watch(con, ExecutionLimits(), deadline_at, None, False, interrupted=interrupted)


def test_an_ended_watch_never_touches_its_connection() -> None:
    """Proves a tick after the execution's block ended interrupts nothing (fails when the done mark is not
    checked: a late interrupt would stop the connection's next query)."""
    con = _Connection()
    watch = _watch(con, time.monotonic() + HOUR_S)
    with watch:
        pass
    assert watch.tick(time.monotonic() + 2 * HOUR_S) is None
    assert con.interrupts == 0


def test_the_deadline_fires_and_interrupts_until_the_execution_ends() -> None:
    """Proves the watch fires at the deadline and interrupts again every poll until the block ends (an
    interrupt between two statements is not kept by DuckDB), then stops."""
    con = _Connection()
    watch = _watch(con, time.monotonic())
    with watch:
        assert watch.fired.wait(WAIT_S), "the deadline did not fire"
        assert con.repeated.wait(WAIT_S), "the interrupt was not repeated"
    after = con.interrupts
    assert watch.tick(time.monotonic()) is None and con.interrupts == after


def test_executions_share_one_thread_and_leave_nothing_watched() -> None:
    """Proves consecutive executions are watched by one long-lived thread (no thread started per run),
    and that an ended execution is neither watched nor kept alive by the watcher."""
    shared = watcher.watcher()
    con = duckdb.connect()
    before = {t for t in threading.enumerate() if t.name == watcher.THREAD_NAME}
    seen: set[threading.Thread] = set()
    for _ in range(3):
        with _watch(con, time.monotonic() + HOUR_S) as watch:
            con.execute("select 1").fetchall()
            seen |= {t for t in threading.enumerate() if t.name == watcher.THREAD_NAME} - before
    assert not seen - {shared._thread}, "an execution started a watch thread of its own"
    assert shared._thread is not None and shared._thread.is_alive()
    assert shared.watched() == 0
    gone = weakref.ref(watch)
    del watch
    gc.collect()
    assert gone() is None, "the watcher holds on to an ended execution's watch (and its connection)"
    con.close()


def test_a_tick_that_raises_does_not_stop_the_watcher() -> None:
    """Proves one execution's failing tick (a closed connection, a failed cancel) is retried and every
    other watch is still served (fails when the exception ends the one thread that watches them all)."""
    shared = watcher.Watcher()

    class Failing(_Ticks):
        def tick(self, now: float) -> float | None:
            super().tick(now)
            raise RuntimeError("the connection is closed")

    failing, other = Failing(), _Ticks()
    shared.add(failing, time.monotonic())
    assert failing.ticked.wait(WAIT_S)
    shared.add(other, time.monotonic())
    assert other.ticked.wait(WAIT_S), "a watch was never ticked after another's tick raised"
    _wait_ticks(failing, 2, "the failing watch was not tried again")
    shared.remove(failing)
    shared.remove(other)


def test_a_tick_that_raises_is_logged_once_by_its_type_only() -> None:
    """Proves a failing tick is not swallowed silently: one ``execution.watch_failed`` warning naming the
    error's type (never its message, which may quote the step's SQL) however often the tick is retried,
    and none after the watch was removed (fails when the watcher logs nothing, or every retry)."""
    shared = watcher.Watcher()

    class Failing(_Ticks):
        def tick(self, now: float) -> float | None:
            super().tick(now)
            raise RuntimeError("select 'a secret in the sql'")

    failing = Failing()
    with capture_logs() as logs:
        shared.add(failing, time.monotonic())
        _wait_ticks(failing, 3, "the failing watch was not tried again")
        shared.remove(failing)
    failed = [entry for entry in logs if entry["event"] == "execution.watch_failed"]
    assert failed == [{"event": "execution.watch_failed", "error": "RuntimeError", "retry_s": watcher.RETRY_S,
                       "log_level": "warning"}]
    assert "secret" not in repr(logs)


def test_a_thread_asleep_with_nothing_watched_is_woken_by_the_next_watch() -> None:
    """Proves a watch added while the thread sleeps with an empty schedule (until notified) is ticked
    (fails when only a thread with a scheduled instant is notified)."""
    shared = watcher.Watcher()
    first, second = _Ticks(), _Ticks()
    shared.add(first, time.monotonic())
    assert first.ticked.wait(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while shared._asleep_until is None:  # the thread has dropped the first watch and gone to sleep
        assert time.monotonic() < deadline, "the thread did not go back to sleep"
        first.ticked.wait(0.01)
    shared.add(second, time.monotonic() + 0.01)
    assert second.ticked.wait(WAIT_S), "the sleeping thread was not woken by the next watch"
    shared.remove(first)
    shared.remove(second)


def test_an_ended_watch_that_was_ticked_is_not_held_while_the_thread_sleeps() -> None:
    """Proves a watch ticked before its execution ended (every execution longer than the interruption poll)
    is released: the thread keeps no reference to its last batch while it sleeps (a watch holds its result
    collector, up to output.max_bytes)."""
    ticked = threading.Event()

    class Ticked(duckdb_engine._Watch):
        def tick(self, now: float) -> float | None:
            at = super().tick(now)
            ticked.set()
            return at

    watch = Ticked(_Connection(), ExecutionLimits(), time.monotonic() + HOUR_S, None, False,  # type: ignore[arg-type]
                   interrupted=interruption.Interruption())  # fmt: skip
    with watch:
        assert ticked.wait(WAIT_S), "the watch was never ticked: the test would prove nothing"
    released = threading.Event()
    weakref.finalize(watch, released.set)
    del watch
    gc.collect()
    assert released.wait(WAIT_S), "the watcher holds an ended watch (and its result) while it sleeps"


def test_a_slow_cancel_does_not_delay_another_executions_deadline() -> None:
    """Proves the cancel request to a PostgreSQL source (which may wait on the network, up to 10 s) is not
    sent from the shared thread: another execution's deadline fires on time while it hangs."""
    release = threading.Event()

    class HangingStream:
        def cancel(self) -> None:
            release.wait(WAIT_S)

    first = duckdb_engine._Watch(_Connection(), ExecutionLimits(), time.monotonic(), None, False,
                                 streams=(HangingStream(),))  # type: ignore[arg-type]  # fmt: skip
    second = _watch(_Connection(), time.monotonic() + 0.05)
    try:
        with first, second:
            assert first.fired.wait(WAIT_S)
            assert second.fired.wait(WAIT_S / 4), "a hanging cancel held back another execution's deadline"
    finally:
        release.set()


def test_an_unbounded_deadline_does_not_stop_the_watcher() -> None:
    """Proves a watch due at infinity (no time limit) leaves the thread serving the others (fails when the
    wait's timeout overflows and ends the thread)."""
    shared = watcher.Watcher()
    never, soon = _Ticks(), _Ticks()
    shared.add(never, float("inf"))
    assert not never.ticked.wait(0.05)
    shared.add(soon, time.monotonic())
    assert soon.ticked.wait(WAIT_S), "the thread died on an infinite deadline"
    shared.remove(never)
    shared.remove(soon)
